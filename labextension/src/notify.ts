/**
 * Notifications for jobs: one per job the user started (in progress, then done or failed
 * with the server's reason), and for failures of background work if the settings ask.
 */
import { Notification } from '@jupyterlab/apputils';

import { showErrorDialog } from './dialogs';
import { formatKind, formatPhase, formatSizes, jobFraction } from './format';
import type { ISnapshotsModel, ITrackedJob } from './tokens';

const IN_PROGRESS: { [kind: string]: string } = {
  snapshot: 'Snapshotting the kernel of',
  restore: 'Restoring the kernel of',
  suspend: 'Suspending the kernel of',
  resume: 'Resuming the kernel of',
  variables: 'Taking'
};

function progressMessage(tracked: ITrackedJob): string {
  const { job, label } = tracked;
  const what = IN_PROGRESS[job.kind] ?? `${formatKind(job.kind)} of`;
  return `${what} ${label}: ${formatPhase(job)}`;
}

function doneMessage(
  tracked: ITrackedJob,
  store: string | undefined
): {
  message: string;
  type: Notification.TypeOptions;
} {
  const { job, label } = tracked;
  const result = job.result ?? {};
  switch (job.kind) {
    case 'snapshot':
    case 'suspend': {
      if (result.status === 'upload-failed') {
        const local = store !== undefined && store !== 's3';
        return {
          type: 'warning',
          message:
            `Snapshot of ${label} taken but ${local ? 'not stored' : 'not uploaded'} ` +
            `(kept in the work directory, retried later): ${result.error || 'failed'}`
        };
      }
      const what =
        job.kind === 'suspend'
          ? `Kernel of ${label} suspended; running a cell resumes it`
          : `Snapshot of ${label} taken`;
      return {
        type: 'success',
        message:
          result.total_bytes !== undefined
            ? `${what} (${formatSizes(result)}).`
            : `${what}.`
      };
    }
    case 'restore':
      return { type: 'success', message: `Kernel of ${label} restored.` };
    case 'resume':
      return { type: 'success', message: `Kernel of ${label} resumed.` };
    case 'variables':
      return { type: 'success', message: `Took ${label}.` };
    default:
      return { type: 'success', message: `${formatKind(job.kind)} done.` };
  }
}

/** Show notifications for the model's jobs; returns a function that stops it. */
export function connectNotifications(model: ISnapshotsModel): () => void {
  const ids = new Map<string, string>();

  const onStarted = (_: unknown, tracked: ITrackedJob) => {
    if (!tracked.notify || ids.has(tracked.job.id)) {
      return;
    }
    ids.set(
      tracked.job.id,
      Notification.emit(progressMessage(tracked), 'in-progress', {
        autoClose: false,
        progress: jobFraction(tracked.job) ?? undefined
      })
    );
  };

  const onChanged = (_: unknown, tracked: ITrackedJob) => {
    if (tracked.job.status !== 'running' || tracked.job.phase === 'done') {
      // Ended, or about to: `finished` follows (in the same tick when the poll saw it
      // end) and replaces the toast. An update right before a dismissal can bring the
      // toast back, spinning for ever with "done" in it.
      return;
    }
    if (tracked.notify && !ids.has(tracked.job.id)) {
      onStarted(_, tracked);
      return;
    }
    const id = ids.get(tracked.job.id);
    if (id) {
      Notification.update({
        id,
        message: progressMessage(tracked),
        type: 'in-progress',
        autoClose: false,
        progress: jobFraction(tracked.job) ?? undefined
      });
    }
  };

  const onFinished = (_: unknown, tracked: ITrackedJob) => {
    const { job, label } = tracked;
    const id = ids.get(job.id);
    ids.delete(job.id);
    const failed = job.status === 'failed';
    if (!tracked.notify && !(failed && model.settings.notifyBackground)) {
      if (id) {
        Notification.dismiss(id);
      }
      return;
    }
    let message: string;
    let type: Notification.TypeOptions;
    let actions: Notification.IAction[] = [];
    if (failed) {
      const error = job.error ?? {};
      const title = `${formatKind(job.kind)} of ${label} failed`;
      message = `${title}: ${error.message || 'unknown error'}${
        error.hint ? ` ${error.hint}` : ''
      }`;
      type = 'error';
      actions = [
        {
          label: 'Details',
          callback: () => void showErrorDialog(title, error)
        }
      ];
    } else {
      ({ message, type } = doneMessage(tracked, model.policy?.store));
    }
    const options = {
      autoClose: (failed ? false : 6000) as number | false,
      actions
    };
    // A new notification rather than an update of the "in progress" one: JupyterLab
    // drops an update that reaches a toast before it is on screen, and that toast would
    // then spin forever. Dismissals are applied in order, so this cannot get lost.
    if (id) {
      Notification.dismiss(id);
    }
    Notification.emit(message, type, options);
  };

  // Said once (per page), plainly: the store's key would be lost with this machine.
  let keyNoticeShown = false;
  const onModelChanged = () => {
    const notice = model.policy?.key_notice;
    if (notice && !keyNoticeShown) {
      keyNoticeShown = true;
      Notification.warning(notice, { autoClose: false });
    }
  };

  model.jobStarted.connect(onStarted);
  model.jobChanged.connect(onChanged);
  model.jobFinished.connect(onFinished);
  model.changed.connect(onModelChanged);
  return () => {
    model.jobStarted.disconnect(onStarted);
    model.jobChanged.disconnect(onChanged);
    model.jobFinished.disconnect(onFinished);
    model.changed.disconnect(onModelChanged);
  };
}
