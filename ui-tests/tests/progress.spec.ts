/**
 * One progress story (issue 44 item 4), in a real JupyterLab with a real snapshot kernel
 * and the local store: through a whole snapshot and a whole suspend, every painted frame
 * of the panel's job line, the notification and the toolbar's state is recorded; each
 * tells the phases in the one order, "done" once at the end, never "upload" for a local
 * store (the panel and the notification never contradict each other; one may be behind
 * the other, each painting on its own). Then the sizes are named, the
 * relative times tick on one clock, and there is one date format.
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import * as path from 'path';

import {
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

/** The phases in their order, as the panel names them (labextension/src/format.ts). */
const PHASES: [string, string][] = [
  ['queued', 'waiting'],
  ['releasing-gpu-caches', 'releasing gpu caches'],
  ['gpu-checkpoint', 'checkpointing gpu memory'],
  ['comparing', 'finding what memory changed'],
  ['dumping', 'dumping memory'],
  ['hashing', 'hashing'],
  ['uploading', 'uploading'],
  ['storing', 'storing'],
  ['committing', 'committing'],
  ['checking-cache', 'checking the local copy'],
  ['downloading', 'downloading'],
  ['verifying', 'verifying'],
  ['saving-kernel', 'saving the running kernel'],
  ['restoring', 'restoring'],
  ['transferring', 'bringing memory in'],
  ['serialising', 'pickling the variables'],
  ['loading', 'loading them into the kernel'],
  ['done', 'done']
];

/** The rank of the phase a text names after `prefix` (-1: none). */
function rank(text: string, prefix: string): number {
  const at = text.indexOf(prefix);
  if (at < 0) {
    return -1;
  }
  const rest = text.slice(at + prefix.length).toLowerCase();
  const found = PHASES.map(([, label], index) => ({ label, index }))
    .filter(({ label }) => rest.startsWith(label))
    .sort((a, b) => b.label.length - a.label.length)[0];
  if (!found) {
    throw new Error(`no phase in ${JSON.stringify(text)}`);
  }
  return found.index;
}

interface IFrame {
  panel: string;
  toast: string;
  toolbar: string;
}

/** Start recording what the page paints: each frame whose texts changed. */
async function record(page: IJupyterLabPageFixture): Promise<void> {
  await page.evaluate(() => {
    const frames: IFrame[] = [];
    (window as any).progressFrames = frames;
    const text = (selector: string) =>
      [...document.querySelectorAll(selector)]
        .map(node => (node.textContent ?? '').trim())
        .join(' | ');
    const look = () => {
      const frame = {
        panel: text('.jp-KernelSnapshots-target .jp-KernelSnapshots-jobText'),
        toast: text('.Toastify__toast'),
        toolbar: text(
          '.jp-MainAreaWidget:not(.lm-mod-hidden) .jp-KernelSnapshots-indicator'
        )
      };
      const last = frames[frames.length - 1];
      if (
        !last ||
        last.panel !== frame.panel ||
        last.toast !== frame.toast ||
        last.toolbar !== frame.toolbar
      ) {
        frames.push(frame);
      }
      if ((window as any).progressFrames === frames) {
        requestAnimationFrame(look);
      }
    };
    requestAnimationFrame(look);
  });
}

async function recorded(page: IJupyterLabPageFixture): Promise<IFrame[]> {
  return page.evaluate(() => {
    const frames = (window as any).progressFrames as IFrame[];
    (window as any).progressFrames = null;
    return frames;
  });
}

/** A view's story so far: its phase now (-1: none yet). */
class Story {
  now = -1;

  /** Take the phase a frame shows (-1: none); false if it went back. */
  take(phase: number): boolean {
    if (phase < 0 || phase === this.now) {
      return true;
    }
    const forward = phase > this.now;
    this.now = phase;
    return forward;
  }
}

/**
 * Check one job's recording: the panel ("Snapshot: dumping memory") and the notification
 * ("Snapshotting the kernel of NB: dumping memory", then "Snapshot of NB taken") each go
 * forward only, through the one order of phases, end once (the panel never says done,
 * the notification last) and never say "upload" (a local store). How far one is behind
 * the other is not checked: each paints on its own (the notification through
 * react-toastify's queue), and on a loaded machine the notification still said "finding
 * what memory changed" when the panel, past "dumping", said "storing".
 * Returns the phases told, in order.
 */
function checkStory(
  frames: IFrame[],
  kind: string,
  toastPrefix: string,
  done: RegExp
): string[] {
  const DONE = PHASES.length - 1;
  const panel = new Story();
  const toast = new Story();
  const told: string[] = [];
  let ended = false;
  for (const frame of frames) {
    expect(
      [frame.panel, frame.toast, frame.toolbar].join(' '),
      'a local store never says upload'
    ).not.toMatch(/upload/i);
    const p = rank(frame.panel, `${kind}: `);
    const t = done.test(frame.toast) ? DONE : rank(frame.toast, toastPrefix);
    expect(p, `the panel never says done: ${frame.panel}`).not.toBe(DONE);
    expect(ended && p >= 0, `the panel after the end: ${frame.panel}`).toBe(false);
    expect(panel.take(p), `the panel goes forward: ${frame.panel}`).toBe(true);
    expect(toast.take(t), `the notification goes forward: ${frame.toast}`).toBe(true);
    ended = ended || t === DONE;
    const now = PHASES[Math.max(p, t, 0)][0];
    if ((p >= 0 || t >= 0) && told[told.length - 1] !== now) {
      told.push(now);
    }
  }
  expect(ended, 'the notification ended the story').toBe(true);
  expect(told.filter(phase => phase === 'done')).toEqual(['done']);
  expect(told[told.length - 1]).toBe('done');
  return told;
}

test('the panel, the notification and the toolbar tell one story', async ({
  page
}) => {
  await page.goto();
  await newNotebook(page, 'progress.ipynb', SNAPSHOT_KERNEL);
  await page.notebook.setCell(
    0,
    'code',
    'import numpy as np\nstate = np.ones(8_000_000)  # 61 MiB'
  );
  await page.notebook.runCell(0, { inplace: true });
  await page.notebook.save();
  const panel = await openSnapshotsPanel(page);
  await expect(panel.getByRole('status')).toHaveCount(0);
  // Before the first snapshot there is no "cells since last snapshot" (a cell has run).
  const kernel = panel.locator('.jp-KernelSnapshots-kernel');
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  await expect(kernel).toContainText('running');
  await expect(kernel).not.toContainText('since last snapshot');

  // A whole snapshot, from the notebook toolbar.
  await record(page);
  await page.getByRole('button', { name: 'Snapshot', exact: true }).first().click();
  const taken = page.getByText(/Snapshot of progress\.ipynb taken/);
  await expect(taken).toBeVisible();
  await expect(panel.getByRole('status')).toHaveCount(0);
  await expect(snapshotCards(panel)).toHaveCount(1);
  const snapshot = checkStory(
    await recorded(page),
    'Snapshot',
    'Snapshotting the kernel of progress.ipynb: ',
    /Snapshot of progress\.ipynb taken/
  );
  expect(snapshot).toContain('dumping');
  expect(snapshot).toContain('storing');
  // The sizes, named: the image CRIU wrote, what the store keeps, what was new.
  await expect(taken).toContainText(
    /\(image \d+(\.\d)? MiB, stored as \d+(\.\d)? [KM]iB, \d+(\.\d)? [KM]iB new\)/
  );
  const card = snapshotCards(panel).first();
  await expect(card).toContainText(/image \d+(\.\d)? MiB/);
  await expect(card).toContainText(/stored as \d+(\.\d)? [KM]iB/);
  await expect(card).not.toContainText(/upload/i);
  await waitForToasts(page);
  // After it, a cell run is counted.
  await page.notebook.addCell('code', 'more = 1');
  await page.notebook.runCell(1, { inplace: true });
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  await expect(kernel).toContainText('1 cell since last snapshot');

  // A whole suspend, from the panel.
  await record(page);
  await panel.getByRole('button', { name: 'Suspend now' }).click();
  await expect(page.getByText(/Kernel of progress\.ipynb suspended/)).toBeVisible();
  await expect(panel.getByRole('status')).toHaveCount(0);
  const suspend = checkStory(
    await recorded(page),
    'Suspend',
    'Suspending the kernel of progress.ipynb: ',
    /Kernel of progress\.ipynb suspended/
  );
  expect(suspend).toContain('dumping');
  await expect(snapshotCards(panel)).toHaveCount(2);
  await waitForToasts(page);

  // Relative times tick, on one clock: the card and a dialog beside it say the same,
  // and both go on; the date has one format.
  const older = snapshotCards(panel).nth(1);
  const time = older.locator('time').first();
  await expect(time).toHaveText(/^\d+ s ago$/, { timeout: 60_000 });
  await older.getByRole('button', { name: 'Restore' }).click();
  const dialog = page.getByRole('dialog');
  await expect(dialog).toContainText('Restore snapshot?');
  const read = () =>
    page.evaluate(() => {
      const card = document.querySelectorAll(
        '.jp-KernelSnapshots-item time'
      )[1] as HTMLElement;
      const shown = document.querySelector('.jp-Dialog time') as HTMLElement;
      return [card.textContent, shown.textContent];
    });
  const [first, same] = await read();
  expect(same).toBe(first);
  await expect.poll(async () => (await read())[0]).not.toBe(first);
  const [later, alsoLater] = await read();
  expect(alsoLater).toBe(later);
  const clock = await older.locator('.jp-KernelSnapshots-dim').first().textContent();
  expect(clock).toMatch(/^\d\d:\d\d$/);
  await expect(dialog).toContainText(`(${clock}, manual, image `);
  await dialog.screenshot({
    path: path.join(SCREENSHOTS, 'restore-dialog-ticking-time.png')
  });
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-after-snapshot-and-suspend.png')
  });
});
