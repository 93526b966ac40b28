/**
 * Undo a cell (issue 49) in a real JupyterLab with a real snapshot kernel: cells run, each
 * gets its cell checkpoint; undo from the toolbar, then again from the cell's context
 * menu; the undone cells are marked, their outputs stay; the execution count goes on;
 * redo from the command palette; a variable taken back from a checkpoint in the panel's
 * timeline. The kernel prints its own state at each step.
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import { APIRequestContext } from '@playwright/test';
import * as path from 'path';

import {
  cellOutput,
  currentKernelId,
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

const CELLS = [
  'x = 1; y = "set by the second cell"; print("x", x)',
  'x = 2; y = "set by the second cell"; print("x", x)',
  'x = 3; y = "changed by the third"; print("x", x)',
  'print("now", x, y)'
];
const MARK = 'jp-KernelSnapshots-notInState';

/** The kernel's cell checkpoints, once ``count`` are taken and none is under way. */
async function checkpointsSettled(
  request: APIRequestContext,
  kernelId: string,
  count: number
): Promise<{ id: string; cells: { execution_count: number | null }[] }[]> {
  let listed: any = null;
  await expect
    .poll(
      async () => {
        const response = await request.get(
          `/api/snapshots/kernels/${kernelId}/checkpoints`
        );
        listed = response.ok() ? await response.json() : null;
        return !!listed && !listed.taking && listed.checkpoints.length >= count;
      },
      { timeout: 60_000, message: `${count} cell checkpoints` }
    )
    .toBe(true);
  return listed.checkpoints;
}

/** Whether the cell at ``index`` is marked "not in the kernel's state". */
async function marked(
  page: IJupyterLabPageFixture,
  index: number
): Promise<boolean> {
  const cell = await page.notebook.getCellLocator(index);
  return (await cell?.getAttribute('class'))?.includes(MARK) ?? false;
}

async function confirm(page: IJupyterLabPageFixture, button: string) {
  const dialog = page.getByRole('dialog');
  await expect(dialog).toContainText(
    'not the world outside it: files the cells wrote'
  );
  await dialog.getByRole('button', { name: button }).click();
  await expect(dialog).toHaveCount(0);
}

test('run cells, undo twice, redo, take a variable from a checkpoint', async ({
  page,
  request
}) => {
  await page.goto();
  await newNotebook(page, 'undo.ipynb', SNAPSHOT_KERNEL);
  const kernelId = await currentKernelId(page);
  // The kernel's "start" checkpoint, taken once it is idle, before the first cell.
  await checkpointsSettled(request, kernelId, 1);

  await page.notebook.setCell(0, 'code', CELLS[0]);
  for (const code of CELLS.slice(1)) {
    await page.notebook.addCell('code', code);
  }
  for (let i = 0; i < 3; i++) {
    await page.notebook.runCell(i, { inplace: true });
    expect(await cellOutput(page, i)).toContain(`x ${i + 1}`);
    await checkpointsSettled(request, kernelId, i + 2);
  }

  // Undo the last cell from the notebook toolbar.
  const panel = await openSnapshotsPanel(page);
  await page.getByRole('button', { name: 'Undo cell' }).first().click();
  await confirm(page, 'Undo cells');
  await expect.poll(() => marked(page, 2)).toBe(true);
  expect(await marked(page, 1)).toBe(false);
  expect(await cellOutput(page, 2)).toContain('x 3'); // its output stays

  // Undo again, from the second cell's context menu: back to before it.
  await (await page.notebook.getCellLocator(1))!.click({ button: 'right' });
  await page
    .getByRole('menuitem', { name: 'Back to Before This Cell' })
    .click();
  await confirm(page, 'Undo cells');
  await expect.poll(() => marked(page, 1)).toBe(true);
  await page.notebook.runCell(3, { inplace: true });
  expect(await cellOutput(page, 3)).toContain('now 1 set by the second cell');
  // The execution count went on: the fourth cell ran as [4], not [2].
  await expect(
    (await page.notebook.getCellLocator(3))!.locator('.jp-InputPrompt')
  ).toContainText('[4]');
  await waitForToasts(page);
  await page.screenshot({
    path: path.join(SCREENSHOTS, 'undo-marked-cells.png')
  });

  // Redo, from the command palette: back to where the first undo began.
  await page.keyboard.press('Control+Shift+C');
  await page.keyboard.type('Redo Cells');
  await page.keyboard.press('Enter');
  await confirm(page, 'Redo');
  await expect.poll(() => marked(page, 2)).toBe(false);
  expect(await marked(page, 1)).toBe(false);
  await page.notebook.runCell(3, { inplace: true });
  expect(await cellOutput(page, 3)).toContain('now 3 changed by the third');

  // Take y back from the checkpoint after the second cell, in the panel's timeline.
  const checkpoints = await checkpointsSettled(request, kernelId, 4);
  const second = checkpoints.find(c =>
    c.cells.some(cell => cell.execution_count === 2)
  );
  expect(second, 'a checkpoint after the second cell').toBeTruthy();
  const timeline = panel.getByRole('list', { name: 'Timeline' });
  await timeline.getByRole('button', { name: 'Checkpoint [2]' }).click();
  await panel.getByRole('button', { name: 'Contents' }).click();
  await panel.getByRole('checkbox', { name: 'Take y' }).check();
  await panel.getByRole('textbox', { name: 'New name for y' }).fill('y_before');
  await panel.getByRole('button', { name: 'Take back y' }).click();
  await expect
    .poll(
      async () => {
        const response = await request.get('/api/snapshots/kernels');
        const kernels = (await response.json()).kernels as any[];
        return kernels.find(k => k.kernel_id === kernelId)?.job ?? null;
      },
      { timeout: 120_000, message: 'the take-back job ends' }
    )
    .toBeNull();
  await page.notebook.addCell('code', 'print(y_before, "/", y)');
  await page.notebook.runCell(4, { inplace: true });
  expect(await cellOutput(page, 4)).toContain(
    'set by the second cell / changed by the third'
  );
  await waitForToasts(page);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-timeline.png')
  });
});
