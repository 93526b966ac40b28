/**
 * A training loop survives the loss of its node, and its output stays in its own cell.
 *
 * Two real Jupyter servers, A and B (tests/support/nodes_for_ui.py), share one S3 store (moto)
 * and one notebook directory. In Chromium: a notebook on A runs a loop that prints a line
 * every 0.25 s; a snapshot is taken from the toolbar mid-loop; A and all its kernels are
 * killed with SIGKILL; the notebook is opened on B, which offers the snapshot; after the
 * restore the cell shows as running, the loop's next lines appear in that same cell, and
 * the cell ends with the execution count the loop had on A.
 *
 * Plain Playwright pages, one browser context per server: Galata's fixtures talk to the
 * token-less JupyterLab at the base URL, while these servers have tokens.
 */
import { expect, Locator, Page, test } from '@playwright/test';
import * as path from 'path';

import {
  openSnapshotsPanel,
  SCREENSHOTS,
  waitForToasts,
  snapshotCards
} from './helpers';
import { api, Nodes, openNotebook } from './twonodes';

const NOTEBOOK = 'loop.ipynb';
const CELL_ID = 'training-loop';
const LINES = 160; // 40 s at 0.25 s a line: the loop is still running on B
const LOOP = [
  'import time',
  `for step in range(${LINES}):`,
  '    print(f"step {step}", flush=True)',
  '    time.sleep(0.25)',
  'print("loop done")'
].join('\n');

/** The loop's code cell. */
function loopCell(page: Page): Locator {
  return page.locator('.jp-MainAreaWidget:visible .jp-Notebook .jp-CodeCell');
}

/**
 * A screenshot of a cell with a long output: scrolled outputs (as a click on the output
 * prompt does), at their end.
 */
async function screenshotCell(cell: Locator, name: string): Promise<void> {
  if (
    !/jp-mod-outputsScrolled/.test((await cell.getAttribute('class')) ?? '')
  ) {
    await cell.locator('.jp-OutputArea-promptOverlay').click();
    await expect(cell).toHaveClass(/jp-mod-outputsScrolled/);
  }
  await cell.evaluate(node => {
    node.querySelectorAll('*').forEach(child => {
      if (child.scrollHeight > child.clientHeight + 1) {
        child.scrollTop = child.scrollHeight;
      }
    });
  });
  await cell.screenshot({ path: path.join(SCREENSHOTS, name) });
}

/** The highest step the cell's output shows (-1 if none). */
async function lastStep(cell: Locator): Promise<number> {
  const text = (await cell.locator('.jp-OutputArea').textContent()) ?? '';
  const steps = [...text.matchAll(/step (\d+)/g)].map(m => Number(m[1]));
  return steps.length ? Math.max(...steps) : -1;
}

test.describe('Two nodes', () => {
  let nodes: Nodes | null = null;

  test.beforeAll(async () => {
    nodes = await Nodes.launch();
  });

  test.afterAll(async () => {
    await nodes?.stop();
  });

  test('a loop resumed on another node prints into its own cell', async ({
    browser,
    request
  }) => {
    test.setTimeout(420_000);
    const { a, b } = nodes!;
    expect(nodes!.running, 'tests.support.nodes_for_ui still runs').toBe(true);

    // The notebook, in the directory both nodes share; its cell has a fixed id.
    await api(request, a, 'PUT', `api/contents/${NOTEBOOK}`, {
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
            id: CELL_ID,
            cell_type: 'code',
            source: LOOP,
            metadata: {},
            outputs: [],
            execution_count: null
          }
        ]
      }
    });

    // Node A: run the loop, save the notebook while it runs, snapshot from the toolbar.
    const pageA = await openNotebook(browser, a, NOTEBOOK);
    await expect(pageA.getByText('Python 3 (snapshots) | Idle')).toBeVisible({
      timeout: 60_000
    });
    const cellA = loopCell(pageA);
    await cellA.locator('.cm-content').click();
    await pageA.keyboard.press('Control+Enter');
    await expect(cellA.locator('.jp-InputPrompt')).toHaveText('[*]:');
    await expect(cellA.locator('.jp-OutputArea')).toContainText('step 4');
    // The save's own reply says when it is written: jupyter_server writes a
    // notebook in place, so a read during a save (this one, or an autosave)
    // finds it empty and is tried again.
    const saved = pageA.waitForResponse(
      response =>
        response.url().includes(`api/contents/${NOTEBOOK}`) &&
        response.request().method() === 'PUT'
    );
    await pageA.keyboard.press('Control+s');
    expect((await saved).ok(), 'JupyterLab saved the notebook').toBe(true);
    await expect
      .poll(
        async () => {
          const response = await request.get(
            `${a.url}api/contents/${NOTEBOOK}`,
            { headers: { Authorization: `token ${a.token}` } }
          );
          // -1: unreadable at this moment (written in place)
          return response.ok()
            ? (await response.json()).content.cells[0].outputs.length
            : -1;
        },
        { message: 'the notebook is saved with the first lines' }
      )
      .toBeGreaterThan(0);
    await pageA
      .getByRole('button', { name: 'Snapshot', exact: true })
      .first()
      .click();
    await expect(pageA.getByText(`Snapshot of ${NOTEBOOK} taken`)).toBeVisible({
      timeout: 120_000
    });
    const atSnapshot = await lastStep(cellA);
    expect(atSnapshot, 'the loop was running at the snapshot').toBeLessThan(
      LINES - 20
    );

    // The snapshot records the running cell (node B sees it in the shared store).
    const listed = (
      await api(request, b, 'GET', `api/snapshots?path=${NOTEBOOK}`)
    ).snapshots;
    expect(listed).toHaveLength(1);
    expect(listed[0].running_request?.cell_id).toBe(CELL_ID);
    expect(listed[0].running_request?.execution_count).toBe(1);

    // Node A is lost: the server and every process it started, kill -9.
    await nodes!.kill('a');
    await pageA.context().close();

    // Node B: the notebook opens without a kernel and offers the snapshot.
    const pageB = await openNotebook(browser, b, NOTEBOOK);
    const offer = pageB.getByRole('dialog');
    await expect(offer).toContainText('Restore the kernel from its snapshot?', {
      timeout: 60_000
    });
    await offer.getByRole('button', { name: 'Restore newest' }).click();

    // The cell runs again, and the loop's next lines appear in it.
    await expect(loopCell(pageB)).toHaveCount(1);
    const cellB = loopCell(pageB).first();
    await expect(cellB.locator('.jp-InputPrompt')).toHaveText('[*]:', {
      timeout: 120_000
    });
    await expect
      .poll(() => lastStep(cellB), {
        timeout: 120_000,
        message: 'lines the loop printed on node B'
      })
      .toBeGreaterThan(atSnapshot + 8);
    await waitForToasts(pageB);
    await screenshotCell(cellB, 'nodes-resumed-cell-running.png');

    // It ends normally, with the execution count it had on node A.
    await expect(cellB.locator('.jp-OutputArea')).toContainText('loop done', {
      timeout: 120_000
    });
    await expect(cellB.locator('.jp-InputPrompt')).toHaveText('[1]:');
    expect(await lastStep(cellB)).toBe(LINES - 1);
    await expect(pageB.getByText('Python 3 (snapshots) | Idle')).toBeVisible();
    await screenshotCell(cellB, 'nodes-resumed-cell-done.png');

    // The kernel answers the next cell as usual.
    await pageB.keyboard.press('Escape');
    await pageB.keyboard.press('b'); // a new cell below
    await pageB.keyboard.press('Enter');
    await pageB.keyboard.type('print(step)');
    await pageB.keyboard.press('Control+Enter');
    await expect(
      loopCell(pageB).nth(1).locator('.jp-OutputArea-output')
    ).toHaveText(`${LINES - 1}`);
    await expect(loopCell(pageB).nth(1).locator('.jp-InputPrompt')).toHaveText(
      '[2]:'
    );

    // From the panel, the same snapshot in place of node B's kernel: the loop goes on
    // again from where it was at the snapshot, in the same cell, and ends again.
    const panel = await openSnapshotsPanel(pageB);
    await snapshotCards(panel)
      .filter({ hasText: 'manual' })
      .getByRole('button', { name: 'Restore' })
      .click();
    await pageB
      .getByRole('dialog')
      .getByRole('button', { name: 'Restore snapshot' })
      .click();
    await expect(
      pageB.getByText(`Kernel of ${NOTEBOOK} restored.`)
    ).toBeVisible({ timeout: 120_000 });
    await expect(cellB.locator('.jp-InputPrompt')).toHaveText('[*]:');
    const output = cellB.locator('.jp-OutputArea');
    await expect
      .poll(
        async () =>
          ((await output.textContent()) ?? '').split('loop done').length - 1,
        {
          timeout: 120_000,
          message: 'the loop ended a second time in its cell'
        }
      )
      .toBe(2);
    await expect(cellB.locator('.jp-InputPrompt')).toHaveText('[1]:');
    await expect(
      loopCell(pageB).nth(1).locator('.jp-OutputArea-output')
    ).toHaveText(`${LINES - 1}`);
    await pageB.context().close();
  });
});
