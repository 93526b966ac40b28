/**
 * What the panel, the commands and the restore offer do with a notebook: take, restore,
 * delete, suspend; with the confirmations the settings ask for.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ServiceManager } from '@jupyterlab/services';

import {
  confirmDelete,
  confirmOverwrite,
  confirmRestore,
  showErrorDialog
} from './dialogs';
import { baseName, formatKind } from './format';
import { describeError, SnapshotAPIError } from './request';
import {
  expectResumed,
  IOPubRecorder,
  ResumedCell,
  resumedRequest
} from './resume';
import {
  IJob,
  IKernelDeath,
  INotebookTarget,
  ISnapshot,
  ISnapshotsModel,
  SNAPSHOT_KERNEL_DISPLAY_NAME,
  SNAPSHOT_KERNEL_NAME
} from './tokens';

/** What the actions need besides the model. */
export interface IActionContext {
  model: ISnapshotsModel;
  services: ServiceManager.IManager;
  /** The open notebook with that path, if any. */
  findNotebook: (path: string) => NotebookPanel | null;
  /** The open notebook whose kernel took the snapshot or came from it (its lineage). */
  findNotebookOf: (snapshot: ISnapshot) => NotebookPanel | null;
  /** Open a notebook (after a restore into a new kernel). */
  openNotebook: (path: string) => void;
}

/** The notebook target of a notebook panel: its path and kernel. */
export function notebookTarget(
  panel: NotebookPanel,
  services: ServiceManager.IManager
): INotebookTarget {
  const sessionContext = panel.sessionContext;
  const kernel = sessionContext.session?.kernel ?? null;
  return {
    path: services.contents.localPath(panel.context.path),
    kernelId: kernel?.id ?? null,
    kernelName: kernel?.name ?? '',
    kernelDisplayName: kernel ? sessionContext.kernelDisplayName : ''
  };
}

/** Whether a notebook's kernel is a snapshot kernel (by its kernelspec or the server). */
export function isSnapshotKernel(
  model: ISnapshotsModel,
  target: INotebookTarget | null
): boolean {
  if (!target?.kernelId) {
    return false;
  }
  const status = model.kernelStatus(target.kernelId);
  return (
    status?.snapshots === true ||
    (target.kernelName === SNAPSHOT_KERNEL_NAME && status === null)
  );
}

/** Report a request that failed before any job existed. */
export function notifyError(what: string, error: unknown): void {
  const { message, hint } = describeError(error);
  Notification.error(`${what}: ${message}${hint ? ` ${hint}` : ''}`, {
    autoClose: false,
    actions: [
      {
        label: 'Details',
        callback: () => void showErrorDialog(what, { message, hint })
      }
    ]
  });
}

/** Ask for a snapshot of a notebook's kernel; the model follows the job. */
export async function snapshotNotebook(
  context: IActionContext,
  panel: NotebookPanel
): Promise<IJob | null> {
  const { model, services } = context;
  const target = notebookTarget(panel, services);
  if (!target.kernelId) {
    notifyError(
      `Cannot snapshot ${baseName(target.path)}`,
      notSnapshotKernelError(target)
    );
    return null;
  }
  if (
    target.kernelName !== SNAPSHOT_KERNEL_NAME &&
    model.kernelStatus(target.kernelId)?.snapshots !== true
  ) {
    notifyKernelChoice(panel, target);
    return null;
  }
  try {
    const tracked = await model.snapshot(target.kernelId);
    tracked.label = baseName(target.path);
    return tracked.job;
  } catch (error) {
    notifyError(`Snapshot of ${baseName(target.path)} failed`, error);
    return null;
  }
}

/** Suspend (snapshot, then end the process) or resume a notebook's kernel. */
export async function suspendOrResume(
  context: IActionContext,
  panel: NotebookPanel,
  action: 'suspend' | 'resume'
): Promise<IJob | null> {
  const { model, services } = context;
  const target = notebookTarget(panel, services);
  if (!target.kernelId || !isSnapshotKernel(model, target)) {
    notifyKernelChoice(panel, target);
    return null;
  }
  try {
    const tracked =
      action === 'suspend'
        ? await model.suspend(target.kernelId)
        : await model.resume(target.kernelId);
    tracked.label = baseName(target.path);
    return tracked.job;
  } catch (error) {
    notifyError(
      `${formatKind(action)} of ${baseName(target.path)} failed`,
      error
    );
    return null;
  }
}

function notSnapshotKernelError(target: INotebookTarget) {
  return {
    message: target.kernelId
      ? `${baseName(target.path)} runs "${target.kernelDisplayName || target.kernelName}", not a snapshot kernel.`
      : `${baseName(target.path)} has no kernel.`,
    hint: `Choose the kernel "${SNAPSHOT_KERNEL_DISPLAY_NAME}".`
  };
}

/** Tell the user that this needs the snapshot kernel, with a button to switch to it. */
export function notifyKernelChoice(
  panel: NotebookPanel,
  target: INotebookTarget
): void {
  const { message, hint } = notSnapshotKernelError(target);
  Notification.warning(`${message} ${hint}`, {
    autoClose: 10000,
    actions: [
      {
        label: `Use ${SNAPSHOT_KERNEL_DISPLAY_NAME}`,
        callback: () => void useSnapshotKernel(panel)
      }
    ]
  });
}

/** Switch a notebook to a new snapshot kernel. */
export async function useSnapshotKernel(panel: NotebookPanel): Promise<void> {
  try {
    await panel.sessionContext.changeKernel({ name: SNAPSHOT_KERNEL_NAME });
  } catch (error) {
    notifyError(
      `Cannot start "${SNAPSHOT_KERNEL_DISPLAY_NAME}" for ${baseName(panel.context.path)}`,
      error
    );
  }
}

/** Where a snapshot's notebook is now ('' for a snapshot of no notebook). */
function notebookNow(snapshot: ISnapshot): string {
  return snapshot.notebook_path_now ?? snapshot.notebook_path ?? '';
}

/** How a snapshot is restored for its notebook (see `restoreSnapshot`). */
type RestoreMode = 'in-place' | 'start-kernel' | 'new-kernel';

/**
 * Restore a snapshot for its notebook, after confirmation if the settings ask for it.
 *
 * - The notebook's kernel is a snapshot kernel: restore in place (`kernel_id`).
 * - It runs another kernel: a new kernel attached to the notebook (`path`); the notebook
 *   then connects to it and the old kernel is shut down.
 * - The notebook is open without a kernel: a snapshot kernel is started, then restored in
 *   place (so that the open notebook keeps one session).
 * - The notebook is not open: a new kernel attached to it (`path`), then it is opened.
 */
export async function restoreSnapshot(
  context: IActionContext,
  snapshot: ISnapshot,
  options: { confirm: boolean; path?: string }
): Promise<IJob | null> {
  // The notebook asked from (the panel's), else the open one whose kernel the snapshot is
  // of, wherever it moved since; else the snapshot's notebook where it was.
  const panel = options.path
    ? context.findNotebook(options.path)
    : (context.findNotebookOf(snapshot) ??
      (notebookNow(snapshot)
        ? context.findNotebook(notebookNow(snapshot))
        : null));
  const target = panel ? notebookTarget(panel, context.services) : null;
  const path = target?.path ?? options.path ?? notebookNow(snapshot);
  const name = baseName(path) || 'a new kernel';
  const mode: RestoreMode =
    panel && target && !target.kernelId
      ? 'start-kernel'
      : target?.kernelId && isSnapshotKernel(context.model, target)
        ? 'in-place'
        : 'new-kernel';

  if (
    options.confirm &&
    !(await confirmRestore(snapshot, name, target, mode === 'in-place'))
  ) {
    return null;
  }
  try {
    if (panel && mode === 'start-kernel') {
      return await restoreIntoNewSnapshotKernel(context, panel, snapshot, name);
    }
    if (panel && mode === 'in-place' && target?.kernelId) {
      return await restoreInPlace(
        context,
        panel,
        snapshot.id,
        target.kernelId,
        name
      );
    }
    return await restoreIntoNewKernel(context, snapshot, {
      path,
      panel,
      oldKernelId: target?.kernelId ?? null,
      name
    });
  } catch (error) {
    notifyError(`Restore of ${name} failed`, error);
    return null;
  }
}

/**
 * An open notebook without a kernel: give it the snapshot's kernel (its kernelspec: "R
 * (snapshots)" for an R snapshot), restore into it.
 */
async function restoreIntoNewSnapshotKernel(
  context: IActionContext,
  panel: NotebookPanel,
  snapshot: ISnapshot,
  name: string
): Promise<IJob> {
  const spec = snapshot.kernel_spec?.name;
  await panel.sessionContext.changeKernel({
    name: typeof spec === 'string' && spec ? spec : SNAPSHOT_KERNEL_NAME
  });
  const kernelId = panel.sessionContext.session?.kernel?.id;
  if (!kernelId) {
    throw new Error(`No kernel could be started for ${name}.`);
  }
  return restoreInPlace(context, panel, snapshot.id, kernelId, name);
}

/**
 * Restore into a new kernel attached to the notebook `path` (or to none). An open
 * notebook follows the new kernel and its old kernel is shut down if nothing else uses
 * it; a notebook that is not open is opened.
 */
async function restoreIntoNewKernel(
  context: IActionContext,
  snapshot: ISnapshot,
  options: {
    path: string;
    panel: NotebookPanel | null;
    oldKernelId: string | null;
    name: string;
  }
): Promise<IJob> {
  const { model, services } = context;
  const { path, panel, oldKernelId, name } = options;
  // The open notebook's own session follows the restored kernel, whatever its path.
  const sessionId = panel?.sessionContext.session?.id;
  const tracked = await model.restore(
    snapshot.id,
    path
      ? { path, ...(sessionId ? { session_id: sessionId } : {}) }
      : ({} as { path: string }),
    name
  );
  const job = await finishRestore(context, tracked);
  const newKernelId = job?.result?.kernel_id as string | undefined;
  if (job?.status !== 'done' || !newKernelId) {
    return job;
  }
  // A cell running at the snapshot goes on in the new kernel: show it in its cell.
  const request = await resumedRequest(model, newKernelId, job.result);
  if (panel) {
    // The server pointed the notebook's session at the new kernel: follow it.
    const resumed = ResumedCell.follow(panel, request);
    await panel.sessionContext.changeKernel({ id: newKernelId });
    void resumed?.check(model, newKernelId);
    if (oldKernelId && oldKernelId !== newKernelId) {
      await shutdownIfUnused(services, oldKernelId);
    }
  } else if (path) {
    if (request) {
      expectResumed(path, request, newKernelId);
    }
    context.openNotebook(path);
  }
  return job;
}

/**
 * Restore into the notebook's own kernel. A cell the snapshot was running goes on at
 * once, before the job's end is known here: its messages are recorded meanwhile.
 */
async function restoreInPlace(
  context: IActionContext,
  panel: NotebookPanel,
  snapshotId: string,
  kernelId: string,
  name: string
): Promise<IJob> {
  const { model } = context;
  const recorder = new IOPubRecorder(panel);
  try {
    const job = await finishRestore(
      context,
      await model.restore(snapshotId, { kernel_id: kernelId }, name)
    );
    if (job.status === 'done') {
      const request = await resumedRequest(model, kernelId, job.result);
      // The recorder hands over to the follower with no message in between.
      const resumed = ResumedCell.follow(panel, request, recorder.stop());
      void resumed?.check(model, kernelId);
    }
    return job;
  } finally {
    recorder.stop();
  }
}

async function finishRestore(
  context: IActionContext,
  tracked: { job: IJob }
): Promise<IJob> {
  const job = await context.model.waitFor(tracked.job.id);
  void context.model.refresh();
  return job;
}

/** The snapshot offered back for a kernel that died, restored into it (its notebook). */
export async function restoreOffered(
  context: IActionContext,
  panel: NotebookPanel,
  kernelId: string,
  death: IKernelDeath
): Promise<IJob | null> {
  const name = baseName(panel.context.path);
  if (!death.snapshot_id) {
    return null;
  }
  try {
    return await restoreInPlace(
      context,
      panel,
      death.snapshot_id,
      kernelId,
      name
    );
  } catch (error) {
    notifyError(`Restore of ${name} failed`, error);
    return null;
  }
}

/** Shut a kernel down if no session uses it any more. */
async function shutdownIfUnused(
  services: ServiceManager.IManager,
  kernelId: string
): Promise<void> {
  await services.sessions.refreshRunning();
  for (const session of services.sessions.running()) {
    if (session.kernel?.id === kernelId) {
      return;
    }
  }
  try {
    await services.kernels.shutdown(kernelId);
  } catch {
    // Already gone.
  }
}

/**
 * Copy variables from a snapshot into the notebook's running kernel. A name the kernel
 * has already is replaced only once the user says so (the server refuses it otherwise).
 */
export async function takeVariables(
  context: IActionContext,
  snapshot: ISnapshot,
  target: INotebookTarget,
  names: string[],
  rename: { [name: string]: string } = {}
): Promise<IJob | null> {
  if (!target.kernelId) {
    return null;
  }
  const label =
    names.map(n => (rename[n] ? `${n} as ${rename[n]}` : n)).join(', ') +
    ` into ${baseName(target.path)}`;
  const take = (overwrite: boolean) =>
    context.model.takeVariables(
      snapshot.id,
      target.kernelId as string,
      names,
      rename,
      label,
      overwrite
    );
  try {
    let tracked;
    try {
      tracked = await take(false);
    } catch (error) {
      if (
        !(error instanceof SnapshotAPIError) ||
        error.code !== 'variables-exist' ||
        !(await confirmOverwrite(baseName(target.path), error.message))
      ) {
        throw error;
      }
      tracked = await take(true);
    }
    const job = await context.model.waitFor(tracked.job.id);
    if (job.status === 'failed' && job.error) {
      void showErrorDialog('Variables not taken', job.error);
    }
    return job;
  } catch (error) {
    if (error instanceof SnapshotAPIError && error.code === 'variables-exist') {
      return null; // The user kept the kernel's own.
    }
    notifyError(`Taking ${names.join(', ')} failed`, error);
    return null;
  }
}

/** Delete a snapshot, after confirmation if the settings ask for it. */
export async function deleteSnapshot(
  context: IActionContext,
  snapshot: ISnapshot,
  options: { confirm: boolean }
): Promise<boolean> {
  if (options.confirm && !(await confirmDelete(snapshot))) {
    return false;
  }
  try {
    await context.model.delete(snapshot.id);
    return true;
  } catch (error) {
    notifyError('Cannot delete the snapshot', error);
    return false;
  }
}
