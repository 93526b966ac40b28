/**
 * After a node loss (or a server restart): a notebook opens, its kernel is gone, but the
 * store has snapshots of it. Before JupyterLab starts a fresh kernel, offer to restore the
 * newest snapshot instead (or to pick another one in the panel).
 *
 * JupyterLab starts a notebook's kernel in `SessionContext.initialize()`: if the server
 * has a session for the path it connects to it, else it starts a new kernel. We run the
 * offer first; a restore creates the session on the server (`POST .../restore` with the
 * notebook `path`), so that `initialize()` then simply connects to the restored kernel.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ServerConnection, ServiceManager } from '@jupyterlab/services';
import * as React from 'react';

import { notifyError } from './actions';
import { RelativeTime } from './components/common';
import {
  baseName,
  formatBytes,
  formatClock,
  formatSizes,
  formatTrigger,
  parseDate
} from './format';
import { ResumedCell, resumedRequest, takeExpectedResume } from './resume';
import type { IRunningRequest, ISnapshot, ISnapshotsModel } from './tokens';

export interface IRecoveryOptions {
  model: ISnapshotsModel;
  services: ServiceManager.IManager;
  /** Whether to offer at all (the `offerRestoreOnOpen` setting, read when a notebook opens). */
  enabled: () => boolean;
  /** Show the panel (the "Pick in panel" button). */
  openPanel: () => void;
}

/** Wrap the session start of a new notebook panel with the restore offer. */
export function offerRestoreOnOpen(
  panel: NotebookPanel,
  options: IRecoveryOptions
): void {
  const sessionContext = panel.sessionContext;
  const initialize = sessionContext.initialize.bind(sessionContext);
  let offered: Promise<IResumed | null> | null = null;
  sessionContext.initialize = () => {
    if (!offered) {
      offered = maybeOffer(panel, options).catch(error => {
        console.warn('kernel snapshots: restore offer failed', error);
        return null;
      });
    }
    return offered.then(async resumed => {
      const result = await initialize();
      // Connected: a cell that ended before this notebook subscribed ends here too.
      void resumed?.cell?.check(options.model, resumed.kernelId);
      return result;
    });
  };
}

/** A kernel restored for the notebook, and its resumed cell (if any), followed there. */
interface IResumed {
  cell: ResumedCell | null;
  kernelId: string;
}

/**
 * Follow the cell a restored kernel goes on running (restored here by the offer, or by
 * the panel before it opened the notebook), before the notebook connects to the kernel.
 */
async function followResumed(
  panel: NotebookPanel,
  kernelId: string,
  request: IRunningRequest | null
): Promise<IResumed | null> {
  await panel.context.ready;
  return { cell: ResumedCell.follow(panel, request), kernelId };
}

/** Whether a notebook has a cell with code in it (a new, empty notebook gets no offer). */
function hasCode(panel: NotebookPanel): boolean {
  const cells = panel.context.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type === 'code' && cell.sharedModel.getSource().trim()) {
      return true;
    }
  }
  return false;
}

async function maybeOffer(
  panel: NotebookPanel,
  options: IRecoveryOptions
): Promise<IResumed | null> {
  const { services } = options;
  const restored = takeExpectedResume(
    services.contents.localPath(panel.context.path)
  );
  if (restored) {
    // Restored from the panel while the notebook was closed: it connects to that kernel.
    return followResumed(panel, restored.kernelId, restored.request);
  }
  const preference = panel.sessionContext.kernelPreference;
  if (
    !options.enabled() ||
    preference.shouldStart === false ||
    preference.canStart === false
  ) {
    return null;
  }
  await panel.context.ready;
  if (panel.isDisposed || !hasCode(panel)) {
    return null;
  }
  const offer = await snapshotToOffer(panel, options, null);
  if (offer === 'running' || offer === null) {
    return null; // Its kernel is alive (JupyterLab connects to it), or nothing to offer.
  }
  return restoreIfWanted(panel, options, offer);
}

/**
 * The newest snapshot of a notebook without a running kernel (of its path, or of the
 * lineage of the kernel it lost), 'running' if the server has a session for it, null
 * if it has no snapshot.
 */
async function snapshotToOffer(
  panel: NotebookPanel,
  options: IRecoveryOptions,
  lineage: string | null
): Promise<{ newest: ISnapshot; count: number } | 'running' | null> {
  const { model, services } = options;
  const path = services.contents.localPath(panel.context.path);
  await services.sessions.ready;
  await services.sessions.refreshRunning();
  for (const session of services.sessions.running()) {
    if (session.path === panel.context.path || session.path === path) {
      return 'running';
    }
  }
  const snapshots = await model.snapshotsOf(path, lineage);
  if (snapshots.length === 0 || panel.isDisposed) {
    return null;
  }
  return { newest: snapshots[0], count: snapshots.length };
}

/** Ask, and restore the newest snapshot into a new kernel for the notebook if wanted. */
async function restoreIfWanted(
  panel: NotebookPanel,
  options: IRecoveryOptions,
  offer: { newest: ISnapshot; count: number }
): Promise<IResumed | null> {
  const { model, services } = options;
  const path = services.contents.localPath(panel.context.path);
  const choice = await askRestore(path, offer.newest, offer.count);
  if (choice === 'panel') {
    options.openPanel();
    return null;
  }
  if (choice !== 'restore') {
    return null;
  }
  try {
    const tracked = await model.restore(
      offer.newest.id,
      { path },
      baseName(path)
    );
    const job = await model.waitFor(tracked.job.id);
    const kernelId = job.result?.kernel_id as string | undefined;
    if (job.status === 'done' && kernelId) {
      await services.sessions.refreshRunning();
      // A cell running at the snapshot goes on: its output goes to its cell.
      const request = await resumedRequest(model, kernelId, job.result);
      return await followResumed(panel, kernelId, request);
    }
  } catch (error) {
    notifyError(`Restore of ${baseName(path)} failed`, error);
  }
  return null;
}

/**
 * An open notebook whose session the server no longer has (the server restarted, or
 * stopped it): once the server answers again, offer its snapshot as when it opens
 * (restored into a new kernel the notebook then connects to), else give it a new kernel
 * of the same kind, as JupyterLab does when a notebook opens. A shutdown asked here is no
 * loss.
 */
export function offerRestoreOnLoss(
  panel: NotebookPanel,
  options: IRecoveryOptions
): void {
  const sessionContext = panel.sessionContext;
  sessionContext.sessionChanged.connect((_, change) => {
    const lost = change.oldValue;
    if (
      change.name !== 'session' ||
      change.newValue !== null ||
      !lost ||
      sessionContext.isTerminating ||
      panel.isDisposed
    ) {
      return;
    }
    const kernelName = lost.kernel?.name ?? '';
    if (!kernelName) {
      // Its kernel went first: shut down here (Kernel > Shut Down Kernel), no loss; and
      // a kernel without a name would be the default kernelspec's, not the notebook's.
      return;
    }
    const lineage =
      options.model.kernelStatus(lost.kernel?.id)?.lineage ?? null;
    void afterLoss(panel, options, kernelName, lineage).catch(error =>
      console.warn('kernel snapshots: offer after a lost kernel failed', error)
    );
  });
}

/**
 * After the server could not be reached: the open notebooks whose session it no longer
 * has (it restarted) let go of it, which offers their snapshot (offerRestoreOnLoss).
 * JupyterLab's own session poll may stand by while its "Server Connection Error" shows,
 * and would find out only later.
 */
export async function dropLostSessions(
  tracker: INotebookTracker,
  services: ServiceManager.IManager
): Promise<void> {
  const settings = services.serverSettings;
  const response = await ServerConnection.makeRequest(
    URLExt.join(settings.baseUrl, 'api', 'sessions'),
    {},
    settings
  );
  if (!response.ok) {
    return;
  }
  const alive = new Set(
    ((await response.json()) as { id: string }[]).map(session => session.id)
  );
  tracker.forEach(panel => {
    const session = panel.sessionContext.session;
    if (session && !alive.has(session.id)) {
      session.dispose();
    }
  });
}

async function afterLoss(
  panel: NotebookPanel,
  options: IRecoveryOptions,
  kernelName: string,
  lineage: string | null
): Promise<void> {
  const { model } = options;
  if (model.unreachableSince !== null) {
    await new Promise<void>(resolve => {
      const back = () => {
        model.reconnected.disconnect(back);
        resolve();
      };
      model.reconnected.connect(back);
    });
  }
  const sessionContext = panel.sessionContext;
  if (panel.isDisposed || sessionContext.session) {
    return; // Closed, or connected again meanwhile.
  }
  const offer = options.enabled()
    ? await snapshotToOffer(panel, options, lineage)
    : null;
  if (offer !== null && offer !== 'running') {
    const resumed = await restoreIfWanted(panel, options, offer);
    if (resumed) {
      await sessionContext.changeKernel({ id: resumed.kernelId });
      void resumed.cell?.check(model, resumed.kernelId);
      return;
    }
  }
  if (!panel.isDisposed && !sessionContext.session) {
    // The server's session for it (if it has one now), else a new kernel.
    const running = [...options.services.sessions.running()].find(
      session => session.path === panel.context.path
    );
    await sessionContext.changeKernel(
      running?.kernel ? { id: running.kernel.id } : { name: kernelName }
    );
  }
}

async function askRestore(
  path: string,
  snapshot: ISnapshot,
  count: number
): Promise<'restore' | 'fresh' | 'panel'> {
  const date = parseDate(snapshot.created);
  const body = React.createElement(
    'div',
    { className: 'jp-KernelSnapshots-offer' },
    React.createElement(
      'p',
      null,
      `${baseName(path)} has no running kernel, but its kernel was snapshotted `,
      React.createElement(RelativeTime, { iso: snapshot.created }),
      ` (${formatClock(date)}, ${formatTrigger(snapshot.trigger)}, ${formatSizes(snapshot)}` +
        `${snapshot.gpu_bytes ? `, GPU ${formatBytes(snapshot.gpu_bytes)}` : ''}` +
        `${snapshot.host ? `, on ${snapshot.host}` : ''}).`
    ),
    React.createElement(
      'p',
      null,
      'Restore it to get the variables back, or start a new kernel' +
        (count > 1
          ? ` (${count - 1} older snapshot${count > 2 ? 's are' : ' is'} in the Kernel Snapshots panel).`
          : '.')
    )
  );
  const result = await showDialog({
    title: 'Restore the kernel from its snapshot?',
    body,
    buttons: [
      Dialog.cancelButton({ label: 'Start new kernel' }),
      Dialog.cancelButton({ label: 'Pick in panel', displayType: 'default' }),
      Dialog.okButton({ label: 'Restore newest' })
    ],
    defaultButton: 2
  });
  switch (result.button.label) {
    case 'Restore newest':
      return 'restore';
    case 'Pick in panel':
      return 'panel';
    default:
      return 'fresh';
  }
}
