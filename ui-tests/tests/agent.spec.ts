/**
 * The Kernel Snapshots panel in agent mode (docs/agent.md): JupyterLab served from a user
 * pod at Pod Security baseline (no capability, no_new_privs, a seccomp filter), whose
 * kernels the node agent dumps and restores. Run by tests/test_container.py (the container
 * stage, scripts/container-tests.sh -k baseline), which starts the agent and the pod, and
 * gives the pod's URL and token, and the pid of the S3 server (moto) its store is in;
 * skipped elsewhere. Through the user's eyes: a snapshot taken from the toolbar, seen
 * while it runs and then listed; a suspend shown in the panel and next to the kernel
 * status; the next cell resumes the kernel with its state; a restore in place from the
 * panel brings a changed variable back.
 */
import { expect } from '@jupyterlab/galata';

import {
  cellOutput,
  currentKernelId,
  kernelStatus,
  newNotebook,
  openSnapshotsPanel,
  shutDownSessions,
  SNAPSHOT_KERNEL,
  snapshotCards,
  test,
  waitForToasts
} from './helpers';

const URL = process.env.UI_TESTS_AGENT_URL ?? '';
const TOKEN = process.env.UI_TESTS_AGENT_TOKEN ?? '';
const STORE_PID = Number(process.env.UI_TESTS_AGENT_STORE_PID ?? '0');
const NOTEBOOK = 'agent.ipynb';

test.skip(
  !URL || !TOKEN || !STORE_PID,
  'needs a user pod at baseline with the node agent: UI_TESTS_AGENT_URL, ' +
    'UI_TESTS_AGENT_TOKEN and UI_TESTS_AGENT_STORE_PID, set by tests/test_container.py ' +
    '(scripts/container-tests.sh -k baseline)'
);
// Every request of the browser and of the tests' own API calls carries the pod's token.
test.use({
  autoGoto: false,
  baseURL: URL.replace(/\/$/, ''),
  extraHTTPHeaders: { Authorization: `token ${TOKEN}` }
});
test.afterEach(async ({ request }) => {
  holdStore(false); // whatever failed while it was held
  await shutDownSessions(request);
});

/** Stop (or continue) the S3 server of the pod's store: a store that does not answer
 * holds a snapshot in its upload, so its running state shows whatever the machine's
 * speed (boto3 waits 60 s for an answer). */
function holdStore(hold: boolean): void {
  process.kill(STORE_PID, hold ? 'SIGSTOP' : 'SIGCONT');
}

test('agent mode: snapshot, suspend, resume and restore in place from the panel', async ({
  page,
  request
}) => {
  await page.goto();
  await newNotebook(page, NOTEBOOK, SNAPSHOT_KERNEL);
  await page.notebook.setCell(0, 'code', 'x = 42');
  await page.notebook.addCell('code', 'print(x)');
  await page.notebook.runCell(0, { inplace: true });
  await page.notebook.runCell(1, { inplace: true });
  expect((await cellOutput(page, 1)).trim()).toBe('42');
  await page.notebook.save();
  const kernelId = await currentKernelId(page);
  expect((await kernelStatus(request, kernelId)).snapshots).toBe(true);

  const panel = await openSnapshotsPanel(page);
  await expect(
    panel.getByText('No snapshots of this notebook yet')
  ).toBeVisible();

  // A snapshot from the notebook toolbar, seen while it runs (the store held).
  holdStore(true);
  await page
    .getByRole('button', { name: 'Snapshot', exact: true })
    .first()
    .click();
  await expect(panel.getByRole('status').first()).toContainText('Snapshot:');
  await expect(
    page.getByRole('status', { name: /Kernel snapshot state: snapshotting/ })
  ).toBeVisible();
  holdStore(false);
  await expect(
    page.getByText(`Snapshot of ${NOTEBOOK} taken`).first()
  ).toBeVisible();
  const items = snapshotCards(panel);
  await expect(items).toHaveCount(1);
  await expect(items.first()).toContainText('manual');
  await expect(items.first()).toContainText('complete');
  await expect(panel.getByRole('status')).toHaveCount(0);
  await expect(
    page.getByRole('status', { name: /Kernel snapshot state/ })
  ).toHaveCount(0);

  // Suspend: the kernel's process ends; the panel and the indicator say so.
  await panel.getByRole('button', { name: 'Suspend now' }).click();
  await expect(
    page.getByText(`Kernel of ${NOTEBOOK} suspended`).first()
  ).toBeVisible();
  await expect(panel.getByText('Kernel suspended')).toBeVisible();
  await expect(panel.getByRole('button', { name: 'Resume now' })).toBeVisible();
  await expect(
    page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
  ).toBeVisible();
  expect((await kernelStatus(request, kernelId)).state).toBe('suspended');
  await expect(items).toHaveCount(2);

  // The next cell resumes it, with its state.
  await page.notebook.runCell(1, { inplace: true });
  expect((await cellOutput(page, 1)).trim()).toBe('42');
  await expect(panel.getByText('Kernel suspended')).toHaveCount(0);
  await expect(
    page.getByRole('status', { name: 'Kernel snapshot state: suspended' })
  ).toHaveCount(0);
  expect((await kernelStatus(request, kernelId)).state).toBe('running');

  // x changes; the first snapshot restored in place brings it back.
  await page.notebook.addCell('code', 'x = 43\nprint(x)');
  await page.notebook.runCell(2, { inplace: true });
  expect((await cellOutput(page, 2)).trim()).toBe('43');
  await waitForToasts(page);
  await items.nth(1).getByRole('button', { name: 'Restore' }).click();
  const dialog = page.getByRole('dialog');
  await expect(dialog).toContainText('Restore snapshot?');
  await expect(dialog).toContainText('is replaced');
  await dialog.getByRole('button', { name: 'Restore snapshot' }).click();
  await expect(
    page.getByText(`Kernel of ${NOTEBOOK} restored.`).first()
  ).toBeVisible();
  await page.notebook.runCell(1, { inplace: true });
  expect((await cellOutput(page, 1)).trim()).toBe('42');
  expect(await currentKernelId(page)).toBe(kernelId);
  expect((await kernelStatus(request, kernelId)).state).toBe('running');
});
