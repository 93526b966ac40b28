/**
 * Helpers of the Kernel Snapshots UI tests.
 */
import { IJupyterLabPageFixture } from '@jupyterlab/galata';
import { APIRequestContext, expect, Locator } from '@playwright/test';
import { execFileSync } from 'child_process';
import * as path from 'path';

export const SCREENSHOTS = path.resolve(__dirname, '..', 'screenshots');

export const SNAPSHOT_KERNEL = 'python3-snapshot';

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
  const id = await page.evaluate(() => {
    const widget = (window as any).galata.app.shell.currentWidget;
    return widget?.sessionContext?.session?.kernel?.id ?? null;
  });
  expect(id, 'the current notebook has a kernel').toBeTruthy();
  return id as string;
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
export async function openSnapshotsPanel(
  page: IJupyterLabPageFixture
): Promise<Locator> {
  const panel = page.getByRole('region', { name: 'Kernel Snapshots' });
  if (!(await panel.isVisible())) {
    await page.getByRole('tab', { name: 'Kernel Snapshots' }).click();
  }
  await expect(panel).toBeVisible();
  return panel;
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

/** The text output of a cell, joined. */
export async function cellOutput(
  page: IJupyterLabPageFixture,
  index: number
): Promise<string> {
  return ((await page.notebook.getCellTextOutput(index)) ?? []).join('');
}

/** Wait until the notifications (toasts) are gone, so that screenshots show the panel. */
export async function waitForToasts(
  page: IJupyterLabPageFixture
): Promise<void> {
  await expect(page.locator('.Toastify__toast')).toHaveCount(0, {
    timeout: 20_000
  });
}
