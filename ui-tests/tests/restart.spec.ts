/**
 * The panel is never stale (issue 44 item 3): a server killed and started again under an
 * open page (tests/support/nodes_for_ui.py, server A at the same URL). While it is down the panel
 * says it cannot be reached and shows no kernel state; once it is back, without a reload,
 * the notebook's kernel state comes back and its snapshot is offered, restored, and the
 * notebook runs again (not "Initializing" for ever).
 */
import { expect, Page, test } from '@playwright/test';
import * as path from 'path';

import { openSnapshotsPanel, SCREENSHOTS, snapshotCards } from './helpers';
import { INode, Nodes } from './twonodes';

const NOTEBOOK = 'restart.ipynb';

test.describe('A server restarted under an open page', () => {
  let nodes: Nodes | null = null;

  test.beforeAll(async () => {
    nodes = await Nodes.launch();
  });

  test.afterAll(async () => {
    await nodes?.stop();
  });

  test('the panel says so, and offers the kernel back when the server is', async ({
    browser,
    request
  }) => {
    test.setTimeout(300_000);
    const node = nodes!.a;
    const notebook = {
      type: 'notebook',
      content: {
        nbformat: 4,
        nbformat_minor: 5,
        metadata: {
          kernelspec: {
            name: 'python3-snapshot',
            display_name: 'Python 3 (snapshots)',
            language: 'python'
          }
        },
        cells: [
          {
            cell_type: 'code',
            source: 'x = 42',
            metadata: {},
            outputs: [],
            execution_count: null
          },
          {
            cell_type: 'code',
            source: 'print(x)',
            metadata: {},
            outputs: [],
            execution_count: null
          }
        ]
      }
    };
    const put = await request.put(`${node.url}api/contents/${NOTEBOOK}`, {
      data: notebook,
      headers: { Authorization: `token ${node.token}` }
    });
    expect(put.ok()).toBeTruthy();
    const page = await open(browser, node);
    await runCell(page, 0);
    const panel = await openSnapshotsPanel(page);
    await expect(panel.getByText('running', { exact: true })).toBeVisible();
    await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
    await expect(snapshotCards(panel)).toHaveCount(1);

    // The server (and its kernels) killed: the panel says so, and no "running".
    await nodes!.kill('a');
    const lost = panel.getByRole('note').filter({
      hasText: 'The server cannot be reached'
    });
    await expect(lost).toBeVisible();
    await expect(panel.getByText('running', { exact: true })).toHaveCount(0);
    await panel.screenshot({
      path: path.join(SCREENSHOTS, 'panel-server-unreachable.png')
    });

    // Back, at the same URL: the panel says so, and the offer comes without a reload,
    // once JupyterLab's own "Server Connection Error" (shown while the server was away)
    // is closed: JupyterLab shows one dialog at a time.
    await nodes!.start('a');
    await expect(lost).toHaveCount(0, { timeout: 60_000 });
    const jupyterlabs = page
      .getByRole('dialog')
      .filter({ hasText: 'Server Connection Error' });
    while ((await jupyterlabs.count()) > 0) {
      await jupyterlabs.first().getByRole('button', { name: 'Close' }).click();
    }
    const offer = page
      .getByRole('dialog')
      .filter({ hasText: 'Restore the kernel from its snapshot?' });
    await expect(offer).toBeVisible({ timeout: 60_000 });
    await expect(offer).toContainText(`${NOTEBOOK} has no running kernel`);
    await offer.screenshot({
      path: path.join(SCREENSHOTS, 'restore-offer-after-server-restart.png')
    });
    await offer.getByRole('button', { name: 'Restore newest' }).click();
    await expect(page.getByText(`Kernel of ${NOTEBOOK} restored.`)).toBeVisible();
    await expect(panel.getByText('running', { exact: true })).toBeVisible();
    await runCell(page, 1);
    await expect(cell(page, 1).locator('.jp-OutputArea-output')).toHaveText('42');
    await page.context().close();
  });
});

async function open(
  browser: import('@playwright/test').Browser,
  node: INode
): Promise<Page> {
  const context = await browser.newContext({
    viewport: { width: 1400, height: 900 }
  });
  const page = await context.newPage();
  await page.goto(`${node.url}lab/tree/${NOTEBOOK}?token=${node.token}`);
  await expect(page.getByRole('tab', { name: 'Kernel Snapshots' })).toBeVisible({
    timeout: 60_000
  });
  return page;
}

function cell(page: Page, index: number) {
  return page
    .locator('.jp-MainAreaWidget:visible .jp-Notebook .jp-CodeCell')
    .nth(index);
}

/** Run a cell with Shift+Enter, once its kernel is idle, and wait for its count. */
async function runCell(page: Page, index: number): Promise<void> {
  await expect(page.getByText(/Python 3 \(snapshots\) \| Idle/)).toBeVisible({
    timeout: 60_000
  });
  const target = cell(page, index);
  await target.locator('.jp-InputArea-editor').click();
  await page.keyboard.press('Shift+Enter');
  await expect(target.locator('.jp-InputPrompt')).toHaveText(/\[\d+\]:/, {
    timeout: 60_000
  });
}
