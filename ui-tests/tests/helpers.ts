/**
 * Helpers of the Kernel Snapshots UI tests.
 */
import { IJupyterLabPageFixture, test as base } from '@jupyterlab/galata';
import { APIRequestContext, expect, Locator, Page } from '@playwright/test';
import { execFileSync } from 'child_process';
import * as path from 'path';

export const SCREENSHOTS = path.resolve(__dirname, '..', 'screenshots');

export const SNAPSHOT_KERNEL = 'python3-snapshot';

/** A page showing JupyterLab: Galata's fixture, or a plain Playwright page. */
export type LabPage = Omit<Page, 'goto'>;

/**
 * Galata's test with the real kernels and sessions APIs: its default mocks only show the
 * page the sessions it created itself, and a restore creates its session on the server.
 * Tests shut their kernels down with shutDownSessions in afterEach.
 */
export const test = base.extend({
  // eslint-disable-next-line no-empty-pattern
  kernels: async ({}, use) => {
    await use(null);
  },
  // eslint-disable-next-line no-empty-pattern
  sessions: async ({}, use) => {
    await use(null);
  }
});

/** Shut down every session (and so its kernel) on the server. */
export async function shutDownSessions(
  request: APIRequestContext
): Promise<void> {
  const response = await request.get('/api/sessions');
  for (const session of (await response.json()) as { id: string }[]) {
    await request.delete(`/api/sessions/${session.id}`);
  }
}

export interface IKernelStatus {
  kernel_id: string;
  snapshots: boolean;
  state?: string;
  lineage?: string;
  wrapper_pid?: number;
  inner_pid?: number | null;
  reason?: string;
}

/** The id of the kernel of the notebook in the main area. */
export async function currentKernelId(
  page: IJupyterLabPageFixture
): Promise<string> {
  // A notebook just opened connects to its session's kernel a moment later.
  const id = () =>
    page.evaluate(() => {
      const widget = (window as any).galata.app.shell.currentWidget;
      return widget?.sessionContext?.session?.kernel?.id ?? null;
    });
  await expect
    .poll(id, { message: 'the current notebook has a kernel' })
    .toBeTruthy();
  return (await id()) as string;
}

/** GET /api/snapshots/kernels/{id}. */
export async function kernelStatus(
  request: APIRequestContext,
  kernelId: string
): Promise<IKernelStatus> {
  const response = await request.get(`/api/snapshots/kernels/${kernelId}`);
  expect(response.ok()).toBeTruthy();
  return (await response.json()) as IKernelStatus;
}

/**
 * kill -9 the kernel's wrapper and inner kernel (what a node loss does to them).
 * The pids come from the snapshot API (the wrapper reports both).
 */
export async function killKernel(
  request: APIRequestContext,
  kernelId: string
): Promise<IKernelStatus> {
  const status = await kernelStatus(request, kernelId);
  expect(status.snapshots, 'the kernel runs under the snapshot wrapper').toBe(
    true
  );
  const pids = [status.wrapper_pid, status.inner_pid].filter(
    (pid): pid is number => typeof pid === 'number' && pid > 0
  );
  expect(pids.length).toBe(2);
  execFileSync('kill', ['-9', ...pids.map(String)]);
  return status;
}

/** Open the Kernel Snapshots side panel and return it. */
export async function openSnapshotsPanel(page: LabPage): Promise<Locator> {
  const panel = page.getByRole('region', { name: 'Kernel Snapshots' });
  if (!(await panel.isVisible())) {
    await page.getByRole('tab', { name: 'Kernel Snapshots' }).click();
  }
  await expect(panel).toBeVisible();
  return panel;
}

/** The panel's snapshot cards (a card's own lists, its variables and cells, are list
 * items too: counted by their name, the cards alone). */
export function snapshotCards(panel: Locator): Locator {
  return panel.getByRole('listitem', { name: /^Snapshot from/ });
}

/** Close every dialog the kernel's death may have opened ("Kernel Restarting"...). */
export async function dismissKernelDialogs(
  page: IJupyterLabPageFixture
): Promise<void> {
  const dialog = page.locator('.jp-Dialog');
  for (let i = 0; i < 3; i++) {
    try {
      await dialog.first().waitFor({ state: 'visible', timeout: 5000 });
    } catch {
      return;
    }
    await dialog.first().locator('.jp-mod-accept').first().click();
    await dialog.first().waitFor({ state: 'detached', timeout: 5000 });
  }
}

/**
 * After a save that renamed a file: wait until the file browser lists it, and close
 * the "Directory not found" dialog a listing may have opened meanwhile. jupyter_server
 * answers a directory listing with 404 when a file in it is renamed while it lists (its
 * ``_dir_model`` gets each entry after listing the directory), and the save's refresh
 * of the file browser races the rename that way (seen once on a loaded machine: the
 * dialog then covered the page).
 */
export async function waitForRenamedListing(
  page: LabPage,
  name: string
): Promise<void> {
  await expect(
    page.locator('.jp-DirListing-item', { hasText: name }).first()
  ).toBeAttached();
  const raced = page
    .getByRole('dialog')
    .filter({ hasText: 'Directory not found' });
  // The raced listing began before the rename: its answer is in by now, or nearly.
  await raced
    .waitFor({ state: 'visible', timeout: 2_000 })
    .catch(() => undefined);
  if (await raced.isVisible()) {
    console.log(
      'closing the "Directory not found" dialog of a listing raced by the rename'
    );
    await raced.locator('.jp-mod-accept').first().click();
    await expect(raced).toBeHidden();
  }
}

/** The text output of a cell, joined. */
export async function cellOutput(
  page: IJupyterLabPageFixture,
  index: number
): Promise<string> {
  return ((await page.notebook.getCellTextOutput(index)) ?? []).join('');
}

/**
 * Wait until the notifications (toasts) are gone, so that screenshots show the panel.
 *
 * Toasts pause their auto-close while the mouse is over them, so the mouse moves away
 * first. A toast that stays is reported by its text: an error or a job still "in
 * progress" fails the test (that is a bug to see); a finished job's toast that has not
 * closed by itself yet is hidden with its own button.
 */
export async function waitForToasts(page: LabPage): Promise<void> {
  await page.mouse.move(1, 1);
  const toasts = page.locator('.Toastify__toast');
  try {
    await expect(toasts).toHaveCount(0, { timeout: 20_000 });
    return;
  } catch {
    // Report below.
  }
  const left = await toasts.evaluateAll(nodes =>
    nodes.map(node => ({
      text: (node.textContent ?? '').trim(),
      sticky:
        node.classList.contains('Toastify__toast--error') ||
        node.querySelector('.Toastify__spinner') !== null
    }))
  );
  const sticky = left.filter(toast => toast.sticky);
  expect(
    sticky.map(toast => toast.text),
    'no error or in-progress notification stays'
  ).toEqual([]);
  console.log(
    `closing notifications that stayed: ${left.map(t => t.text).join(' | ')}`
  );
  // One at a time: a toast may also close by itself meanwhile.
  await expect(async () => {
    const hide = toasts.getByRole('button', { name: 'Hide notification' });
    if ((await hide.count()) > 0) {
      await hide.first().click({ timeout: 1_000 });
    }
    await expect(toasts).toHaveCount(0, { timeout: 1_000 });
  }).toPass({ timeout: 10_000 });
}

/**
 * Create an empty notebook for ``kernel`` and open it (its session starts at its path).
 * Galata's ``notebook.createNew`` renames a new notebook while its session starts, and
 * JupyterLab can then leave the server's session at the old path (it sends the old one
 * after the rename): the server files the kernel's snapshots under that path.
 */
export async function newNotebook(
  page: IJupyterLabPageFixture,
  name: string,
  kernel: string
): Promise<void> {
  const displayName =
    kernel === SNAPSHOT_KERNEL
      ? 'Python 3 (snapshots)'
      : 'Python 3 (ipykernel)';
  await page.evaluate(
    async ({ name, kernel, displayName }) => {
      await (window as any).galata.app.serviceManager.contents.save(name, {
        type: 'notebook',
        format: 'json',
        content: {
          nbformat: 4,
          nbformat_minor: 5,
          metadata: {
            kernelspec: {
              name: kernel,
              display_name: displayName,
              language: 'python'
            }
          },
          cells: [
            {
              cell_type: 'code',
              source: '',
              metadata: {},
              outputs: [],
              execution_count: null
            }
          ]
        }
      });
    },
    { name, kernel, displayName }
  );
  expect(await page.notebook.openByPath(name)).toBe(true);
  await page.notebook.activate(name);
}
