/**
 * An R notebook survives the loss of its node (IRkernel behind the wrapper's bridge, "R
 * (snapshots)": docs/kernels.md).
 *
 * Two real Jupyter servers, A and B (tests/support/nodes_for_ui.py), share one S3 store and one
 * notebook directory. In Chromium: an R notebook on A makes a data.frame and reads a line
 * of a file; a snapshot is taken from the panel, whose card shows the R variables (read
 * in R) and says that they cannot be taken back; A and all its kernels are killed with
 * SIGKILL; the notebook is opened on B, which offers the snapshot; the restored kernel
 * reads the file's next line and still has the data.frame.
 */
import { expect, test } from '@playwright/test';
import * as path from 'path';

import {
  openSnapshotsPanel,
  SCREENSHOTS,
  snapshotCards,
  waitForToasts
} from './helpers';
import { api, Nodes, openNotebook } from './twonodes';

const NOTEBOOK = 'analysis-r.ipynb';
const SETUP = [
  'writeLines(c("one", "two", "three"), "lines.txt")',
  'con <- file("lines.txt", "r")',
  'df <- data.frame(n = 1:1000, sq = (1:1000)^2)',
  'cat(readLines(con, n = 1), sum(df$n))'
].join('\n');

test.describe('An R notebook on two nodes', () => {
  let nodes: Nodes | null = null;

  test.beforeAll(async () => {
    nodes = await Nodes.launch();
  });

  test.afterAll(async () => {
    await nodes?.stop();
  });

  test('is snapshotted, its node lost, restored on the other and used again', async ({
    browser,
    request
  }) => {
    test.setTimeout(300_000);
    const { a, b } = nodes!;
    await api(request, a, 'PUT', `api/contents/${NOTEBOOK}`, {
      type: 'notebook',
      content: {
        nbformat: 4,
        nbformat_minor: 5,
        metadata: {
          kernelspec: {
            name: 'ir-snapshot',
            display_name: 'R (snapshots)',
            language: 'R'
          }
        },
        cells: [
          {
            id: 'setup',
            cell_type: 'code',
            source: SETUP,
            metadata: {},
            outputs: [],
            execution_count: null
          }
        ]
      }
    });

    // Node A: run the cell, snapshot from the panel; the card shows R's variables.
    const pageA = await openNotebook(browser, a, NOTEBOOK);
    await expect(pageA.getByText('R (snapshots) | Idle')).toBeVisible({
      timeout: 60_000
    });
    const cellsA = pageA.locator(
      '.jp-MainAreaWidget:visible .jp-Notebook .jp-CodeCell'
    );
    await cellsA.first().locator('.cm-content').click();
    await pageA.keyboard.press('Control+Enter');
    await expect(cellsA.first().locator('.jp-OutputArea')).toContainText(
      'one 500500'
    );
    const panel = await openSnapshotsPanel(pageA);
    await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
    const card = snapshotCards(panel).first();
    await expect(card).toContainText('df', { timeout: 120_000 });
    await card.getByRole('button', { name: 'Contents' }).click();
    await expect(card.getByRole('list', { name: 'Variables', exact: true })).toContainText(
      'data.frame'
    );
    await expect(card).toContainText(
      'Taking variables back is not available for R kernels'
    );
    await expect(card.getByRole('checkbox', { name: /^Take / })).toHaveCount(0);
    await waitForToasts(pageA);
    await panel.screenshot({
      path: path.join(SCREENSHOTS, 'panel-r-kernel-contents.png')
    });

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
    await expect(pageB.getByText('R (snapshots) | Idle')).toBeVisible({
      timeout: 120_000
    });

    // The restored kernel reads the file on where it was, and has the data.frame.
    const cellsB = pageB.locator(
      '.jp-MainAreaWidget:visible .jp-Notebook .jp-CodeCell'
    );
    await cellsB.first().locator('.cm-content').click();
    await pageB.keyboard.press('Escape');
    await pageB.keyboard.press('b'); // a new cell below
    await pageB.keyboard.press('Enter');
    await pageB.keyboard.type('cat(readLines(con, n = 1), nrow(df))');
    await pageB.keyboard.press('Control+Enter');
    await expect(cellsB.nth(1).locator('.jp-OutputArea')).toContainText(
      'two 1000',
      { timeout: 60_000 }
    );
    await pageB.context().close();
  });
});
