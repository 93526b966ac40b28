/**
 * The Kernel Snapshots panel in a real JupyterLab with real snapshot kernels (CRIU):
 * build a state, snapshot it, kill the kernel with kill -9, restore it from the panel,
 * and let the restored kernel print its own state.
 */
import { expect, galata } from '@jupyterlab/galata';
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
  waitForToasts,
  snapshotCards
} from './helpers';

test.use({ autoGoto: false });
test.afterEach(async ({ request }) => shutDownSessions(request));

const BUILD_STATE = [
  'import hashlib',
  'state = {"answer": 42, "items": list(range(100_000))}',
  'secret = hashlib.sha256(b"kernel snapshots").hexdigest()[:12]',
  'print("built", len(state["items"]), secret)'
].join('\n');

const PRINT_STATE =
  "print(f\"state: answer={state['answer']} items={len(state['items'])} secret={secret}\")";

const SECRET = 'state: answer=ANSWER items=100000 secret=';

test.describe('Kernel Snapshots', () => {
  test('snapshot, kill -9, restore from the panel', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'state.ipynb', SNAPSHOT_KERNEL);

    // Build a state.
    await page.notebook.setCell(0, 'code', BUILD_STATE);
    await page.notebook.addCell('code', PRINT_STATE);
    await page.notebook.runCell(0, { inplace: true });
    expect(await cellOutput(page, 0)).toContain('built 100000');
    await page.notebook.runCell(1, { inplace: true });
    const before = await cellOutput(page, 1);
    expect(before).toContain(SECRET.replace('ANSWER', '42'));
    await page.notebook.save();

    const panel = await openSnapshotsPanel(page);
    await expect(panel.getByText('state.ipynb').first()).toBeVisible();
    await expect(
      panel.getByText('No snapshots of this notebook yet')
    ).toBeVisible();

    // The snapshot command is in the notebook toolbar (and the Kernel menu).
    await page
      .getByRole('button', { name: 'Snapshot', exact: true })
      .first()
      .click();
    await expect(
      page.getByText(/Snapshot of state\.ipynb taken/)
    ).toBeVisible();
    const items = snapshotCards(panel);
    await expect(items).toHaveCount(1);
    await expect(items.first()).toContainText('manual');
    await expect(items.first()).toContainText('complete');
    await expect(items.first()).toContainText('no GPU memory');

    // A second snapshot, with another state, from the panel's own button.
    await page.notebook.addCell('code', 'state["answer"] = 43');
    await page.notebook.runCell(2, { inplace: true });
    await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
    await expect(items).toHaveCount(2);
    await expect(panel.getByRole('status')).toHaveCount(0);
    await expect(items.nth(0)).toContainText('newest');
    await waitForToasts(page);
    await panel.screenshot({
      path: path.join(SCREENSHOTS, 'panel-two-snapshots.png')
    });

    // Kill the kernel process tree: the server restarts a fresh kernel.
    const kernelId = await currentKernelId(page);
    const killed = await killKernel(request, kernelId);
    await dismissKernelDialogs(page);
    await expect
      .poll(
        async () => {
          const status = await kernelStatus(request, kernelId);
          return (
            status.state === 'running' && status.lineage !== killed.lineage
          );
        },
        { timeout: 60_000, message: 'the server restarts the killed kernel' }
      )
      .toBe(true);
    await dismissKernelDialogs(page);

    // The fresh kernel lost the state.
    await page.notebook.runCell(1, { inplace: true });
    expect(await cellOutput(page, 1)).toContain('NameError');

    // Restore the older snapshot (answer=42) from the panel, with the confirmation.
    await items.nth(1).getByRole('button', { name: 'Restore' }).click();
    const dialog = page.getByRole('dialog');
    await expect(dialog).toContainText('Restore snapshot?');
    await dialog.getByRole('button', { name: 'Restore snapshot' }).click();
    await expect(
      page.getByText('Kernel of state.ipynb restored.')
    ).toBeVisible();

    // The restored kernel prints its own state.
    await page.notebook.runCell(1, { inplace: true });
    expect(await cellOutput(page, 1)).toContain(SECRET.replace('ANSWER', '42'));
    expect(await cellOutput(page, 1)).toBe(before);
    await expect(items).toHaveCount(2);
    // The kernel now descends from the older snapshot.
    await expect(items.nth(1)).toContainText('kernel');
    await waitForToasts(page);
    await panel.screenshot({
      path: path.join(SCREENSHOTS, 'panel-after-restore.png')
    });
  });

  test('a notebook whose kernel is gone offers its newest snapshot', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'recover.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', BUILD_STATE);
    await page.notebook.addCell('code', PRINT_STATE);
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();

    // Snapshot through the Kernel menu this time.
    await page.menu.clickMenuItem('Kernel>Snapshot Kernel');
    await expect(
      page.getByText(/Snapshot of recover\.ipynb taken/)
    ).toBeVisible();

    // The kernel and its session disappear (a lost node), the notebook is closed.
    const kernelId = await currentKernelId(page);
    await page.notebook.close(true);
    const sessions = (await (await request.get('/api/sessions')).json()) as {
      id: string;
      kernel: { id: string };
    }[];
    for (const session of sessions.filter(s => s.kernel.id === kernelId)) {
      await request.delete(`/api/sessions/${session.id}`);
    }

    // Reopening it offers the snapshot instead of a fresh kernel.
    await page.notebook.openByPath('recover.ipynb');
    const dialog = page.getByRole('dialog');
    await expect(dialog).toContainText('Restore the kernel from its snapshot?');
    await expect(dialog).toContainText('recover.ipynb has no running kernel');
    await dialog.screenshot({
      path: path.join(SCREENSHOTS, 'restore-offer-dialog.png')
    });
    await dialog.getByRole('button', { name: 'Restore newest' }).click();
    await expect(
      page.getByText('Kernel of recover.ipynb restored.')
    ).toBeVisible();

    await page.notebook.runCell(1, { inplace: true });
    expect(await cellOutput(page, 1)).toContain(SECRET.replace('ANSWER', '42'));
    const restoredKernel = await currentKernelId(page);
    expect(restoredKernel).not.toBe(kernelId);
    expect((await kernelStatus(request, restoredKernel)).state).toBe('running');
  });

  test('restore into a notebook that now runs another kernel', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'switch.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', BUILD_STATE);
    await page.notebook.addCell('code', PRINT_STATE);
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const panel = await openSnapshotsPanel(page);
    await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
    const items = snapshotCards(panel);
    await expect(items).toHaveCount(1);

    // The notebook switches to a plain kernel: the panel says so, the snapshot stays.
    await page.evaluate(async () => {
      const widget = (window as any).galata.app.shell.currentWidget;
      await widget.sessionContext.changeKernel({ name: 'python3' });
    });
    await expect(
      panel.getByText('Not a snapshot kernel', { exact: true })
    ).toBeVisible();
    const plainKernel = await currentKernelId(page);

    // Restoring gives the notebook a new snapshot kernel; the plain one is shut down.
    await items.first().getByRole('button', { name: 'Restore' }).click();
    const dialog = page.getByRole('dialog');
    await expect(dialog).toContainText('gets a new kernel');
    await dialog.getByRole('button', { name: 'Restore snapshot' }).click();
    await expect(
      page.getByText('Kernel of switch.ipynb restored.')
    ).toBeVisible();
    await expect(panel.getByText('Not a snapshot kernel')).toHaveCount(0);
    await page.notebook.runCell(1, { inplace: true });
    expect(await cellOutput(page, 1)).toContain(SECRET.replace('ANSWER', '42'));
    const restoredKernel = await currentKernelId(page);
    expect(restoredKernel).not.toBe(plainKernel);
    expect((await kernelStatus(request, restoredKernel)).snapshots).toBe(true);
    await expect
      .poll(async () => {
        const kernels = (await (await request.get('/api/kernels')).json()) as {
          id: string;
        }[];
        return kernels.some(kernel => kernel.id === plainKernel);
      })
      .toBe(false);
  });

  test('suspend from the panel; running a cell resumes the kernel', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'suspend.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', BUILD_STATE);
    await page.notebook.addCell('code', PRINT_STATE);
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const kernelId = await currentKernelId(page);
    const panel = await openSnapshotsPanel(page);

    await panel.getByRole('button', { name: 'Suspend now' }).click();
    await expect(
      page.getByText(/Kernel of suspend\.ipynb suspended/)
    ).toBeVisible();
    await expect(panel.getByText('Kernel suspended')).toBeVisible();
    await expect(
      page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
    ).toBeVisible();
    expect((await kernelStatus(request, kernelId)).state).toBe('suspended');
    // The suspend left a snapshot; asked for by hand, its trigger is "manual".
    await expect(snapshotCards(panel).first()).toContainText('manual');

    // Running a cell brings the kernel back, with its state.
    await page.notebook.runCell(1, { inplace: true });
    expect(await cellOutput(page, 1)).toContain(SECRET.replace('ANSWER', '42'));
    await expect(panel.getByText('Kernel suspended')).toHaveCount(0);
    expect((await kernelStatus(request, kernelId)).state).toBe('running');
  });

  test("a renamed notebook still lists its kernel's snapshots", async ({
    page
  }) => {
    await page.goto();
    await newNotebook(page, 'before.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', BUILD_STATE);
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const panel = await openSnapshotsPanel(page);
    await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
    const items = snapshotCards(panel);
    await expect(items).toHaveCount(1);

    // Filed under the old path, the snapshot is still the notebook's kernel's.
    await page.contents.renameFile('before.ipynb', 'after.ipynb');
    await expect(panel.getByText('after.ipynb').first()).toBeVisible();
    await expect(items).toHaveCount(1);
    await expect(items.first()).toContainText('manual');
  });

  test('a notebook with another kernel says what to do', async ({ page }) => {
    await page.goto();
    await newNotebook(page, 'plain.ipynb', 'python3');
    const panel = await openSnapshotsPanel(page);
    await expect(
      panel.getByText('Not a snapshot kernel', { exact: true })
    ).toBeVisible();
    await expect(
      panel.getByText(
        'This notebook\'s kernel is not a snapshot kernel: choose "Python 3 (snapshots)".'
      )
    ).toBeVisible();
    await expect(
      panel.getByRole('button', { name: 'Use Python 3 (snapshots)' })
    ).toBeVisible();
    await panel.screenshot({
      path: path.join(SCREENSHOTS, 'panel-not-a-snapshot-kernel.png')
    });
  });
});

test.describe('Server events', () => {
  // Polling once an hour: only the server's events can update the panel in time.
  test.use({
    mockSettings: {
      ...galata.DEFAULT_SETTINGS,
      'jupyter-kernel-snapshots:plugin': { refreshInterval: 3600 }
    }
  });

  test('a snapshot taken elsewhere shows up at once', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'events.ipynb', SNAPSHOT_KERNEL);
    const panel = await openSnapshotsPanel(page);
    await expect(
      panel.getByText('No snapshots of this notebook yet')
    ).toBeVisible();
    await page.notebook.setCell(0, 'code', 'x = 1');
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const kernelId = await currentKernelId(page);

    // Another client (the CLI, a periodic policy...) takes the snapshot.
    const response = await request.post('/api/snapshots', {
      data: { kernel_id: kernelId }
    });
    expect(response.status()).toBe(202);
    await expect(snapshotCards(panel)).toHaveCount(1, {
      timeout: 5_000
    });
    // No notification for work the user did not start here.
    await expect(page.getByText(/Snapshot of events\.ipynb taken/)).toHaveCount(
      0
    );
  });
});
