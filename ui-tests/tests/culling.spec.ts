/**
 * jupyter_server's own kernel culler, as a user of a real JupyterLab sees it (issue 34):
 * the culler ends an idle snapshot kernel by suspending it (cull_action "suspend", the
 * default), so the user's next cell brings it back with its state, in the tab left open
 * (cull_connected on) and in the notebook closed and opened again from the file browser
 * (cull_connected off, jupyter_server's default). A shutdown the user asks for (Kernel >
 * Shut Down Kernel) still just shuts down.
 *
 * The culler needs short timeouts, which the other specs' server must not have: each
 * describe starts a JupyterLab of its own (the same test configuration, the culler's
 * settings on the command line, its own store and work directory) in a worker fixture.
 */
import { expect } from '@jupyterlab/galata';
import { APIRequestContext } from '@playwright/test';
import { ChildProcess, spawn } from 'child_process';
import * as fs from 'fs';
import * as net from 'net';
import * as os from 'os';
import * as path from 'path';

import {
  cellOutput,
  currentKernelId,
  kernelStatus,
  newNotebook,
  openSnapshotsPanel,
  SCREENSHOTS,
  shutDownSessions,
  SNAPSHOT_KERNEL,
  snapshotCards,
  test as base,
  waitForToasts
} from './helpers';

/** Idle this long, a kernel is culled; the culler looks every CULL_INTERVAL seconds. */
const CULL_IDLE_TIMEOUT = 10;
const CULL_INTERVAL = 2;

const SET_X = 'x = 42';
const BIG = [
  'import numpy as np',
  'big = np.ones(20 << 17)  # 20 MiB',
  'print(big.nbytes >> 20, "MiB")'
].join('\n');
const PRINT_X = 'print(x)';

/** A free TCP port on localhost (the OS picks it). */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const port = (server.address() as net.AddressInfo).port;
      server.close(() => resolve(port));
    });
  });
}

/** The server's exit, or null once it has run for ``ms`` without exiting. */
function exited(server: ChildProcess, ms: number): Promise<number | null> {
  return new Promise(resolve => {
    if (server.exitCode !== null) {
      resolve(server.exitCode);
      return;
    }
    const timer = setTimeout(() => resolve(null), ms);
    server.once('exit', code => {
      clearTimeout(timer);
      resolve(code ?? -1);
    });
  });
}

/**
 * Start a JupyterLab whose culler takes snapshot kernels idle for CULL_IDLE_TIMEOUT
 * seconds, and return its URL once /lab answers; its log goes to
 * ui-tests/jupyter-server-culling-<connected|closed>.log.
 */
async function startCullingServer(
  connected: boolean
): Promise<{ url: string; server: ChildProcess }> {
  const port = await freePort();
  const parent = process.env.UI_TESTS_TMP ?? os.tmpdir();
  const tmp = fs.mkdtempSync(path.join(parent, 'culling-'));
  const name = connected ? 'connected' : 'closed';
  const log = fs.openSync(
    path.resolve(__dirname, '..', `jupyter-server-culling-${name}.log`),
    'w'
  );
  const env: NodeJS.ProcessEnv = { ...process.env, UI_TESTS_TMP: tmp };
  delete env.JUPYTERLAB_GALATA_ROOT_DIR;
  const server = spawn(
    'jupyter',
    [
      'lab',
      '--config',
      'jupyter_server_test_config.py',
      `--ServerApp.port=${port}`,
      `--MappingKernelManager.cull_idle_timeout=${CULL_IDLE_TIMEOUT}`,
      `--MappingKernelManager.cull_interval=${CULL_INTERVAL}`,
      `--MappingKernelManager.cull_connected=${connected ? 'True' : 'False'}`
    ],
    { cwd: path.resolve(__dirname, '..'), env, stdio: ['ignore', log, log] }
  );
  const url = `http://localhost:${port}`;
  for (;;) {
    const code = await exited(server, 500);
    if (code !== null) {
      throw new Error(`the culling server exited (${code}): see its log`);
    }
    try {
      if ((await fetch(`${url}/lab`)).ok) {
        return { url, server };
      }
    } catch {
      // Not listening yet.
    }
  }
}

/**
 * Galata's test against a culling server: one for each value of ``cullConnected`` (a
 * describe's option), started when a test first needs it and kept for the worker.
 */
const test = base.extend<
  { cullConnected: boolean },
  { cullingServers: (connected: boolean) => Promise<string> }
>({
  cullConnected: [true, { option: true }],
  cullingServers: [
    // eslint-disable-next-line no-empty-pattern
    async ({}, use) => {
      const started = new Map<
        boolean,
        Promise<{ url: string; server: ChildProcess }>
      >();
      await use(async connected => {
        if (!started.has(connected)) {
          started.set(connected, startCullingServer(connected));
        }
        return (await started.get(connected)!).url;
      });
      for (const pending of started.values()) {
        const { server } = await pending;
        server.kill('SIGTERM');
        if ((await exited(server, 30_000)) === null) {
          server.kill('SIGKILL');
        }
      }
    },
    { scope: 'worker', timeout: 150_000 }
  ],
  baseURL: async ({ cullConnected, cullingServers }, use) => {
    await use(await cullingServers(cullConnected));
  }
});

test.use({ autoGoto: false });
test.afterEach(async ({ request }) => shutDownSessions(request));

/**
 * Wait until the culler has suspended the kernel (its state in the snapshot API: the
 * REST API polled, no fixed wait) and check that the cull left one snapshot of it.
 */
async function waitForCull(
  request: APIRequestContext,
  kernelId: string
): Promise<void> {
  await expect
    .poll(async () => (await kernelStatus(request, kernelId)).state, {
      timeout: 120_000,
      message: 'the culler suspends the idle kernel'
    })
    .toBe('suspended');
  // Suspended once its dump is sealed on this machine; listed once the store has its copy
  // (kernel_jobs.py: the upload comes after), a moment later on a busy machine.
  await expect
    .poll(
      async () => {
        const response = await request.get('/api/snapshots?trigger=cull');
        expect(response.ok()).toBeTruthy();
        const { snapshots } = (await response.json()) as {
          snapshots: { kernel_id: string }[];
        };
        return snapshots.map(s => s.kernel_id);
      },
      { timeout: 60_000, message: "the cull's snapshot in the store" }
    )
    .toContain(kernelId);
  // Still listed: the culler did not shut it down.
  const kernels = (await (await request.get('/api/kernels')).json()) as {
    id: string;
  }[];
  expect(kernels.map(k => k.id)).toContain(kernelId);
}

/** Build the state: x = 42 and a 20 MiB array, the notebook saved. */
async function buildState(page: Parameters<typeof newNotebook>[0]) {
  await page.notebook.setCell(0, 'code', SET_X);
  await page.notebook.addCell('code', BIG);
  await page.notebook.addCell('code', PRINT_X);
  await page.notebook.runCell(0, { inplace: true });
  await page.notebook.runCell(1, { inplace: true });
  expect(await cellOutput(page, 1)).toContain('20 MiB');
  await page.notebook.save();
}

test.describe('Kernel culling, tab open (cull_connected on)', () => {
  test.use({ cullConnected: true });

  test('the culled kernel is suspended; the next cell brings it back', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'culled-open.ipynb', SNAPSHOT_KERNEL);
    await buildState(page);
    const kernelId = await currentKernelId(page);
    const panel = await openSnapshotsPanel(page);

    // Left idle with the tab open: the culler suspends the kernel.
    await waitForCull(request, kernelId);
    await expect(panel.getByText('Kernel suspended')).toBeVisible();
    await expect(
      page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
    ).toBeVisible();
    await expect(
      panel.getByRole('button', { name: 'Resume now' })
    ).toBeVisible();
    await expect(snapshotCards(panel).first()).toContainText('idle cull');
    await waitForToasts(page);
    await page.screenshot({
      path: path.join(SCREENSHOTS, 'culled-kernel-suspended.png')
    });

    // The user runs the next cell in the same tab: the kernel comes back by itself.
    await page.notebook.runCell(2, { inplace: true });
    expect((await cellOutput(page, 2)).trim()).toBe('42');
    expect(await currentKernelId(page)).toBe(kernelId);
    await expect(panel.getByText('Kernel suspended')).toHaveCount(0);
    await expect(
      page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
    ).toHaveCount(0);
    await expect(
      panel.getByRole('button', { name: 'Suspend now' })
    ).toBeVisible();
    await expect(page.getByRole('dialog')).toHaveCount(0);
  });
});

test.describe('Kernel culling, tab closed (cull_connected off)', () => {
  test.use({ cullConnected: false });

  test('the notebook opened again runs its next cell with its state', async ({
    page,
    request
  }) => {
    await page.goto();
    await newNotebook(page, 'culled-closed.ipynb', SNAPSHOT_KERNEL);
    await buildState(page);
    const kernelId = await currentKernelId(page);

    // The tab is closed (its kernel kept, as JupyterLab does): the culler takes it.
    await page.notebook.close();
    await waitForCull(request, kernelId);

    // Opened again from the file browser: the session's kernel, suspended.
    await page.filebrowser.open('culled-closed.ipynb');
    await expect
      .poll(() => page.notebook.isActive('culled-closed.ipynb'))
      .toBe(true);
    expect(await currentKernelId(page)).toBe(kernelId);
    const panel = await openSnapshotsPanel(page);
    await expect(panel.getByText('Kernel suspended')).toBeVisible();
    await expect(
      page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
    ).toBeVisible();
    // The kernel is there: no offer to restore it.
    await expect(page.getByRole('dialog')).toHaveCount(0);
    await waitForToasts(page);
    await page.screenshot({
      path: path.join(SCREENSHOTS, 'culled-notebook-reopened.png')
    });

    await page.notebook.runCell(2, { inplace: true });
    expect((await cellOutput(page, 2)).trim()).toBe('42');
    expect(await currentKernelId(page)).toBe(kernelId);
    await expect(panel.getByText('Kernel suspended')).toHaveCount(0);
    expect((await kernelStatus(request, kernelId)).state).not.toBe('suspended');
  });

  test('Shut Down Kernel still just shuts down', async ({ page, request }) => {
    // The tab stays open, so this server's culler leaves the kernel alone: the
    // shutdown below is the user's alone.
    await page.goto();
    await newNotebook(page, 'shut-down.ipynb', SNAPSHOT_KERNEL);
    await page.notebook.setCell(0, 'code', SET_X);
    await page.notebook.runCell(0, { inplace: true });
    await page.notebook.save();
    const kernelId = await currentKernelId(page);
    const panel = await openSnapshotsPanel(page);

    await page.menu.clickMenuItem('Kernel>Shut Down Kernel');
    await expect
      .poll(async () => {
        const kernels = (await (await request.get('/api/kernels')).json()) as {
          id: string;
        }[];
        return kernels.map(k => k.id);
      })
      .not.toContain(kernelId);
    await expect(
      panel.getByRole('note').getByText('No kernel', { exact: true })
    ).toBeVisible();
    // Not suspended, not snapshotted: nothing to restore, and nothing offered.
    // (The store is this server's: the other test's snapshot may be there.)
    const response = await request.get('/api/snapshots');
    const { snapshots } = (await response.json()) as {
      snapshots: { kernel_id: string }[];
    };
    expect(snapshots.filter(s => s.kernel_id === kernelId)).toEqual([]);
    await expect(panel.getByText('Kernel suspended')).toHaveCount(0);
    await expect(page.getByRole('dialog')).toHaveCount(0);
  });
});
