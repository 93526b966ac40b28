/**
 * A kernel that dies says so in its notebook and offers its snapshot back (issue 44
 * item 1), in a real JupyterLab with real snapshot kernels: its inner kernel killed (the
 * wrapper sees how and tells the server), its wrapper killed too (jupyter_client starts a
 * new kernel under the same id, the server remembers), a kernel without a snapshot (said
 * once), and a real out-of-memory kill under a memory cgroup.
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import { APIRequestContext, Locator } from '@playwright/test';
import { execFileSync } from 'child_process';
import * as fs from 'fs';
import * as path from 'path';

import {
  cellOutput,
  currentKernelId,
  dismissKernelDialogs,
  kernelStatus,
  killKernel,
  newNotebook,
  openSnapshotsPanel,
  SCREENSHOTS,
  shutDownSessions,
  SNAPSHOT_KERNEL,
  test,
  waitForToasts
} from './helpers';

test.use({ autoGoto: false });
test.afterEach(async ({ request }) => shutDownSessions(request));

/** The notice at the top of the current notebook. */
function deathNotice(page: IJupyterLabPageFixture): Locator {
  return page
    .locator('.jp-MainAreaWidget:visible')
    .getByRole('alert', { name: 'The kernel died' });
}

/** A notebook whose kernel holds x = 42, snapshotted, then one more cell run. */
async function stateThenSnapshot(
  page: IJupyterLabPageFixture,
  name: string
): Promise<string> {
  await page.goto();
  await newNotebook(page, name, SNAPSHOT_KERNEL);
  await page.notebook.setCell(0, 'code', 'x = 42');
  await page.notebook.runCell(0, { inplace: true });
  await page.notebook.save();
  const panel = await openSnapshotsPanel(page);
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  await expect(page.getByText(`Snapshot of ${name} taken`)).toBeVisible();
  await page.notebook.addCell('code', 'y = x + 1');
  await page.notebook.runCell(1, { inplace: true });
  await page.notebook.addCell('code', 'print(x)');
  return currentKernelId(page);
}

/** The inner kernel alone killed with SIGKILL (a crash would do the same). */
async function killInner(
  request: APIRequestContext,
  kernelId: string
): Promise<void> {
  const status = await kernelStatus(request, kernelId);
  expect(status.inner_pid).toBeTruthy();
  execFileSync('kill', ['-9', String(status.inner_pid)]);
}

test.describe('A kernel that dies', () => {
  test('its inner kernel killed: the notebook offers the snapshot, restored in place', async ({
    page,
    request
  }) => {
    const kernelId = await stateThenSnapshot(page, 'killed.ipynb');
    await killInner(request, kernelId);
    await dismissKernelDialogs(page);

    const notice = deathNotice(page);
    await expect(notice).toContainText('The kernel died (killed by SIGKILL).');
    await expect(notice).toContainText(/Restore its snapshot from \d\d:\d\d, 1 cell earlier\?/);
    await expect(
      notice.getByRole('list', { name: 'Cells run since the snapshot' })
    ).toContainText('[2] y = x + 1');
    const status = await kernelStatus(request, kernelId);
    const death = (status as any).death;
    expect(death.reason).toBe('killed by SIGKILL');
    expect(death.wrapper).toBe(false);
    expect(death.snapshot_id).toBeTruthy();
    // The panel says it too, not "running" and "cells since last snapshot".
    const panel = await openSnapshotsPanel(page);
    await expect(
      panel.getByRole('alert', { name: 'The kernel died' })
    ).toBeVisible();
    await waitForToasts(page);
    await page
      .locator('.jp-MainAreaWidget:visible')
      .screenshot({ path: path.join(SCREENSHOTS, 'notebook-kernel-died.png') });

    await notice.getByRole('button', { name: 'Restore snapshot' }).click();
    await expect(page.getByText('Kernel of killed.ipynb restored.')).toBeVisible();
    await expect(notice).toHaveCount(0);
    await page.notebook.runCell(2, { inplace: true });
    expect(await cellOutput(page, 2)).toContain('42');
    expect((await kernelStatus(request, kernelId) as any).death).toBeNull();
  });

  test('its wrapper killed too: remembered across the restart; keep the new kernel', async ({
    page,
    request
  }) => {
    const kernelId = await stateThenSnapshot(page, 'wrapper.ipynb');
    await killKernel(request, kernelId);
    await dismissKernelDialogs(page);

    const notice = deathNotice(page);
    await expect(notice).toContainText('The kernel died (killed by SIGKILL).');
    await expect(notice).toContainText(/Restore its snapshot from \d\d:\d\d/);
    expect(((await kernelStatus(request, kernelId)) as any).death.wrapper).toBe(true);
    await waitForToasts(page);

    await notice.getByRole('button', { name: 'Keep the new kernel' }).click();
    await expect(notice).toHaveCount(0);
    expect(((await kernelStatus(request, kernelId)) as any).death).toBeNull();
    await page.notebook.runCell(2, { inplace: true });
    expect(await cellOutput(page, 2)).toContain('NameError');
  });

  test('without a snapshot it says so, once', async ({ page, request }) => {
    await page.goto();
    await newNotebook(page, 'nothing.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', 'x = 1');
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const kernelId = await currentKernelId(page);
    await killInner(request, kernelId);
    await dismissKernelDialogs(page);

    const notice = deathNotice(page);
    await expect(notice).toContainText(
      'It had no snapshot, so what it held is lost'
    );
    await expect(notice).toContainText('[1] x = 1');
    expect(((await kernelStatus(request, kernelId)) as any).death.snapshot_id).toBeNull();
    await waitForToasts(page);
    await page.locator('.jp-MainAreaWidget:visible').screenshot({
      path: path.join(SCREENSHOTS, 'notebook-kernel-died-no-snapshot.png')
    });
    await notice.getByRole('button', { name: 'OK' }).click();
    await expect(notice).toHaveCount(0);
    // Said once: the server forgot it (another page, a refresh, says nothing more).
    expect(((await kernelStatus(request, kernelId)) as any).death).toBeNull();
    const panel = await openSnapshotsPanel(page);
    await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
    await expect(panel.getByRole('alert', { name: 'The kernel died' })).toHaveCount(0);
    await expect(notice).toHaveCount(0);
  });

  test('a real out-of-memory kill under a memory cgroup', async ({
    page,
    request
  }) => {
    const kernelId = await stateThenSnapshot(page, 'oom.ipynb');
    const cgroup = memoryCgroup(300 * 1024 * 1024);
    test.skip(cgroup === null, 'no memory cgroup can be made here');
    try {
      // The kernel (and every process of it) goes into the cgroup; a cell allocates past it.
      const { inner_pid } = await kernelStatus(request, kernelId);
      fs.writeFileSync(path.join(cgroup!, 'cgroup.procs'), String(inner_pid));
      await page.notebook.setCell(
        2,
        'code',
        'big = bytearray(600 * 2**20)  # past the 300 MiB limit'
      );
      // Run without waiting for the cell's end: the kernel dies in it.
      await page.notebook.enterCellEditingMode(2);
      await page.keyboard.press('Control+Enter');
      await dismissKernelDialogs(page);
      const notice = deathNotice(page);
      await expect(notice).toContainText(
        /The kernel died \(killed by the out-of-memory killer at \d+(\.\d)? MiB\)\./
      );
      await expect(notice).toContainText('big = bytearray(600 * 2**20)');
      const death = ((await kernelStatus(request, kernelId)) as any).death;
      expect(death.cause).toBe('oom');
      expect(death.memory_bytes).toBeGreaterThan(200 * 1024 * 1024);
      await waitForToasts(page);
      await page.locator('.jp-MainAreaWidget:visible').screenshot({
        path: path.join(SCREENSHOTS, 'notebook-kernel-oom-killed.png')
      });
      await notice.getByRole('button', { name: 'Restore snapshot' }).click();
      await expect(page.getByText('Kernel of oom.ipynb restored.')).toBeVisible();
      await page.notebook.addCell('code', 'print(x)');
      await page.notebook.runCell(3, { inplace: true });
      expect(await cellOutput(page, 3)).toContain('42');
    } finally {
      removeCgroup(cgroup);
    }
  });
});

/** A memory cgroup (v1 or v2) of `limit` bytes under this process's, or null. */
function memoryCgroup(limit: number): string | null {
  const lines = fs.readFileSync('/proc/self/cgroup', 'utf8').split('\n');
  const v1 = lines.find(line => /^\d+:([^:]*,)?memory(,[^:]*)?:/.test(line));
  const v2 = lines.find(line => line.startsWith('0::'));
  let base: string | null = null;
  let limitFile = '';
  if (v1 && fs.existsSync('/sys/fs/cgroup/memory')) {
    base = path.join('/sys/fs/cgroup/memory', v1.split(':')[2]);
    limitFile = 'memory.limit_in_bytes';
  } else if (v2) {
    const own = path.join('/sys/fs/cgroup', v2.slice(3));
    const control = path.join(own, 'cgroup.subtree_control');
    if (
      fs.existsSync(control) &&
      fs.readFileSync(control, 'utf8').split(/\s+/).includes('memory')
    ) {
      base = own;
      limitFile = 'memory.max';
    }
  }
  if (base === null) {
    return null;
  }
  const dir = path.join(base, `kernel-snapshots-ui-oom-${process.pid}`);
  try {
    fs.mkdirSync(dir);
    fs.writeFileSync(path.join(dir, limitFile), String(limit));
  } catch {
    return null;
  }
  return dir;
}

function removeCgroup(dir: string | null): void {
  if (dir === null || !fs.existsSync(dir)) {
    return;
  }
  const procs = fs
    .readFileSync(path.join(dir, 'cgroup.procs'), 'utf8')
    .split('\n')
    .filter(Boolean);
  for (const pid of procs) {
    try {
      process.kill(Number(pid), 'SIGKILL');
    } catch {
      // gone
    }
  }
  for (let i = 0; i < 100; i++) {
    try {
      fs.rmdirSync(dir);
      return;
    } catch {
      execFileSync('sleep', ['0.1']);
    }
  }
}
