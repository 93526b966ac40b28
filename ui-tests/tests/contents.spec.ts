/**
 * What each snapshot holds, in the panel, with a real JupyterLab, real snapshot kernels
 * and CRIU: cards show the last cell and the biggest variables; the search finds a
 * snapshot by variable name or cell text; two snapshots are compared; a variable deleted
 * in the kernel is taken back from a snapshot while the kernel keeps everything else.
 */
import { expect } from '@jupyterlab/galata';
import { Locator } from '@playwright/test';
import * as path from 'path';

import {
  cellOutput,
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

test('cards show cells and variables; search, compare, take a variable back', async ({
  page
}) => {
  await page.goto();
  await newNotebook(page, 'contents.ipynb', SNAPSHOT_KERNEL);
  const panel = await openSnapshotsPanel(page);
  const items = snapshotCards(panel).filter({ has: page.locator('time') });

  await page.notebook.setCell(
    0,
    'code',
    'import numpy as np\nweights = np.ones((512, 256))\nlabels = ["cat"] * 1000\n' +
      'pixels = np.zeros(25_000_000, dtype=np.uint8)  # a long shape, a long line of code to wrap'
  );
  await page.notebook.runCell(0, { inplace: true });
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  await expect(items).toHaveCount(1);
  await expect(items.first()).toContainText('[1] import numpy as np');
  await expect(items.first()).toContainText('weights');
  await expect(items.first()).toContainText('1.0 MiB');

  await page.notebook.addCell(
    'code',
    'del labels\nweights = weights[:8].copy()\nmetrics = {"loss": 0.25}'
  );
  await page.notebook.runCell(1, { inplace: true });
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  await expect(items).toHaveCount(2);
  await expect(items.first()).toContainText('[2] del labels');

  // The search matches variable names and cell text.
  const search = panel.getByRole('searchbox', {
    name: 'Search snapshots by variable name or cell text'
  });
  await search.fill('labels');
  await expect(items).toHaveCount(2); // a variable of the first, a cell of the second
  await search.fill('metrics');
  await expect(items).toHaveCount(1);
  await expect(items.first()).toContainText('[2] del labels');
  await search.fill('no such thing');
  await expect(items).toHaveCount(0);
  await expect(panel.getByText(/No snapshot holds a variable/)).toBeVisible();
  await search.fill('');
  await expect(items).toHaveCount(2);

  // Compare the two: added, removed, changed; the cells between.
  await items.nth(1).getByRole('button', { name: 'Compare' }).click();
  await items.nth(0).getByRole('button', { name: 'Compare' }).click();
  const comparison = panel.getByRole('region', { name: 'Comparison' });
  await expect(comparison.getByRole('list', { name: 'Added' })).toContainText(
    'metrics'
  );
  await expect(comparison.getByRole('list', { name: 'Removed' })).toContainText(
    'labels'
  );
  await expect(comparison.getByRole('list', { name: 'Changed' })).toContainText(
    'weights'
  );
  await expect(
    comparison.getByRole('list', { name: 'Cells between' })
  ).toContainText('del labels');
  await waitForToasts(page);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-contents-compare.png')
  });
  await comparison.getByRole('button', { name: 'Close' }).click();

  // Take labels back from the first snapshot; the kernel keeps metrics.
  const older = items.nth(1);
  await older.getByRole('button', { name: 'Contents' }).click();
  await expect(
    older.getByRole('list', { name: 'Variables', exact: true })
  ).toContainText(
    'labels'
  );
  await older.getByRole('checkbox', { name: 'Take labels' }).check();
  await older
    .getByRole('textbox', { name: 'New name for labels' })
    .fill('labels_back');
  // Everything fits the card at the default sidebar width: nothing sticks out or is cut,
  // and a variable's shape and size stay on one line.
  await expect(older).toContainText('25000000 uint8, 23.8 MiB');
  expect(await overflowing(older)).toEqual([]);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-contents-take.png')
  });
  await older.getByRole('button', { name: 'Take back labels' }).click();
  await expect(
    page.getByText('Took labels as labels_back into contents.ipynb.')
  ).toBeVisible();
  await page.notebook.addCell(
    'code',
    'print(len(labels_back), labels_back[0], metrics, weights.shape)'
  );
  await page.notebook.runCell(2, { inplace: true });
  expect(await cellOutput(page, 2)).toContain(
    "1000 cat {'loss': 0.25} (8, 256)"
  );

  // weights exists in the kernel: taking it back asks first; Cancel keeps the kernel's.
  await older.getByRole('checkbox', { name: 'Take labels' }).uncheck();
  await older.getByRole('checkbox', { name: 'Take weights' }).check();
  await older.getByRole('button', { name: 'Take back weights' }).click();
  const ask = page.getByRole('dialog');
  await expect(ask).toContainText('Replace variables?');
  await expect(ask).toContainText(
    'The kernel of contents.ipynb already has weights'
  );
  await ask.screenshot({
    path: path.join(SCREENSHOTS, 'take-back-asks-before-replacing.png')
  });
  await ask.getByRole('button', { name: 'Cancel' }).click();
  await page.notebook.addCell('code', 'print(weights.shape)');
  await page.notebook.runCell(3, { inplace: true });
  expect(await cellOutput(page, 3)).toContain('(8, 256)');
  await older.getByRole('button', { name: 'Take back weights' }).click();
  await page.getByRole('dialog').getByRole('button', { name: 'Replace the variables' }).click();
  await expect(
    page.getByText('Took weights into contents.ipynb.')
  ).toBeVisible();
  await page.notebook.runCell(3, { inplace: true });
  expect(await cellOutput(page, 3)).toContain('(512, 256)');
});

/**
 * What sticks out of a card, or is cut in its expanded contents (text wider than its box),
 * and each variable's shape and size taller than one line: a description of each.
 */
async function overflowing(card: Locator): Promise<string[]> {
  return card.evaluate(node => {
    const box = node.getBoundingClientRect();
    const found: string[] = [];
    node.querySelectorAll('*').forEach(child => {
      const element = child as HTMLElement;
      const rect = element.getBoundingClientRect();
      const name = `${element.tagName} "${(element.textContent ?? '').slice(0, 40)}"`;
      if (rect.width > 0 && (rect.left < box.left - 1 || rect.right > box.right + 1)) {
        found.push(`${name} sticks out`);
      }
      // The card's one-line summary ends in an ellipsis by design (its tooltip has all);
      // what the expanded contents show is shown whole.
      const inDetails = element.closest('.jp-KernelSnapshots-details') !== null;
      if (
        inDetails &&
        element.scrollWidth > element.clientWidth + 1 &&
        element.clientWidth > 0
      ) {
        found.push(`${name} is cut`);
      }
    });
    node.querySelectorAll('.jp-KernelSnapshots-variableInfo').forEach(child => {
      const element = child as HTMLElement;
      const line = parseFloat(getComputedStyle(element).lineHeight);
      if (element.offsetHeight > line * 1.5) {
        found.push(`"${element.textContent}" takes more than one line`);
      }
    });
    return found;
  });
}
