/**
 * A restore follows its notebook (issue 44 item 2): a notebook saved first as
 * Untitled.ipynb, snapshotted, renamed to demo.ipynb, snapshotted again, moved into a
 * folder; its kernel killed. The panel still lists both snapshots, the restore names and
 * goes to the notebook where it is now (not the old path), and the restored kernel stays
 * linked to both; after its kernel is lost and the notebook opened again, the offer finds
 * them too.
 */
import { expect } from '@jupyterlab/galata';
import * as path from 'path';

import {
  cellOutput,
  currentKernelId,
  dismissKernelDialogs,
  killKernel,
  newNotebook,
  openSnapshotsPanel,
  SCREENSHOTS,
  shutDownSessions,
  snapshotCards,
  SNAPSHOT_KERNEL,
  test,
  waitForToasts
} from './helpers';

test.use({ autoGoto: false });
test.afterEach(async ({ request }) => shutDownSessions(request));

test('renamed before and after its snapshots, the notebook gets them back', async ({
  page,
  request
}) => {
  await page.goto();
  await newNotebook(page, 'Untitled.ipynb', SNAPSHOT_KERNEL);
  await page.notebook.setCell(0, 'code', 'x = 42');
  await page.notebook.runCell(0, { inplace: true });
  await page.notebook.save();
  const panel = await openSnapshotsPanel(page);
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  const items = snapshotCards(panel);
  await expect(items).toHaveCount(1);

  // Renamed, snapshotted again, then moved into a folder.
  await page.contents.renameFile('Untitled.ipynb', 'demo.ipynb');
  await expect(panel.getByText('demo.ipynb').first()).toBeVisible();
  await page.notebook.addCell('code', 'x = 43');
  await page.notebook.runCell(1, { inplace: true });
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  await expect(items).toHaveCount(2);
  await page.contents.createDirectory('projects');
  await page.contents.renameFile('demo.ipynb', 'projects/demo.ipynb');
  await expect(items).toHaveCount(2);

  // The kernel is lost; keep the new one for now, then restore the first snapshot.
  const kernelId = await currentKernelId(page);
  await killKernel(request, kernelId);
  await dismissKernelDialogs(page);
  const notice = page
    .locator('.jp-MainAreaWidget:visible')
    .getByRole('alert', { name: 'The kernel died' });
  await notice.getByRole('button', { name: 'Keep the new kernel' }).click();
  await expect(items).toHaveCount(2);
  await items.nth(1).getByRole('button', { name: 'Restore' }).click();
  const dialog = page.getByRole('dialog');
  await expect(dialog).toContainText(
    'The kernel of demo.ipynb goes back to the snapshot of demo.ipynb (then Untitled.ipynb)'
  );
  await dialog.screenshot({
    path: path.join(SCREENSHOTS, 'restore-dialog-renamed-notebook.png')
  });
  await dialog.getByRole('button', { name: 'Restore snapshot' }).click();
  await expect(page.getByText('Kernel of demo.ipynb restored.')).toBeVisible();
  await page.notebook.addCell('code', 'print(x)');
  await page.notebook.runCell(2, { inplace: true });
  expect(await cellOutput(page, 2)).toContain('42');
  const sessions = (await (await request.get('/api/sessions')).json()) as {
    path: string;
  }[];
  expect(sessions.map(s => s.path)).toEqual(['projects/demo.ipynb']);
  await expect(items).toHaveCount(2);
  await expect(items.nth(1)).toContainText('kernel');
  await waitForToasts(page);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-renamed-notebook.png')
  });

  // Its kernel and session gone (a node lost), the notebook opened again: the offer
  // finds the snapshots taken under its old names.
  await page.notebook.save();
  await page.notebook.close(true);
  await shutDownSessions(request);
  await page.notebook.openByPath('projects/demo.ipynb');
  const offer = page.getByRole('dialog');
  await expect(offer).toContainText('Restore the kernel from its snapshot?');
  await expect(offer).toContainText('demo.ipynb has no running kernel');
  await offer.getByRole('button', { name: 'Restore newest' }).click();
  await expect(page.getByText('Kernel of demo.ipynb restored.')).toBeVisible();
  await page.notebook.runCell(2, { inplace: true });
  expect(await cellOutput(page, 2)).toContain('43');
  await expect(snapshotCards(await openSnapshotsPanel(page))).toHaveCount(2);
});
