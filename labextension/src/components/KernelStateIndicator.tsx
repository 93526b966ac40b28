import { ReactWidget, UseSignal } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import * as React from 'react';

import { formatKind, formatPhase, jobFraction } from '../format';
import type { ISnapshotsModel } from '../tokens';

const TITLES: { [state: string]: string } = {
  suspended:
    'Kernel suspended: its memory is saved in a snapshot. Running a cell resumes it.',
  restoring: 'The kernel is being restored from a snapshot.',
  snapshotting: 'A snapshot of the kernel is being taken.',
  dead: 'The kernel process died: restore a snapshot (Kernel Snapshots panel).',
  starting: 'The snapshot kernel is starting.',
  stopping: 'The snapshot kernel is stopping.'
};

const LABELS: { [state: string]: string } = {
  suspended: 'suspended',
  restoring: 'restoring…',
  snapshotting: 'snapshotting…',
  dead: 'dead',
  starting: 'starting',
  stopping: 'stopping'
};

const VERBS: { [kind: string]: string } = {
  snapshot: 'snapshotting…',
  restore: 'restoring…',
  suspend: 'suspending…',
  resume: 'resuming…'
};

/** Next to the kernel status in the notebook toolbar: "suspended", "restoring…"… */
export function KernelStateView(props: {
  model: ISnapshotsModel;
  panel: NotebookPanel;
}): JSX.Element | null {
  const { model, panel } = props;
  const kernelId = panel.sessionContext.session?.kernel?.id;
  if (!kernelId) {
    return null;
  }
  const status = model.kernelStatus(kernelId);
  const [tracked] = model.jobsFor(kernelId);
  let state = status?.snapshots ? (status.state ?? 'running') : null;
  let label = state ? LABELS[state] : undefined;
  let title = state ? TITLES[state] : undefined;
  if (tracked) {
    const { job } = tracked;
    const fraction = jobFraction(job);
    state = job.kind === 'snapshot' ? 'snapshotting' : 'restoring';
    label =
      (VERBS[job.kind] ?? job.kind) +
      (fraction === null ? '' : ` ${Math.floor(fraction * 100)}%`);
    title = `${formatKind(job.kind)} in progress: ${formatPhase(job)}`;
  }
  if (!state || !label) {
    return null;
  }
  return (
    <span
      className={`jp-KernelSnapshots-badge jp-KernelSnapshots-state jp-KernelSnapshots-indicator jp-mod-${state}`}
      title={title}
      role="status"
      aria-label={`Kernel snapshot state: ${label}`}
    >
      {label}
    </span>
  );
}

/** The toolbar item of a notebook. */
export class KernelStateIndicator extends ReactWidget {
  constructor(
    private _model: ISnapshotsModel,
    private _panel: NotebookPanel
  ) {
    super();
    this.addClass('jp-KernelSnapshots-indicatorItem');
  }

  render(): JSX.Element {
    return (
      <UseSignal signal={this._model.changed}>
        {() => <KernelStateView model={this._model} panel={this._panel} />}
      </UseSignal>
    );
  }
}
