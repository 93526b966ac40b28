import type { JupyterFrontEnd } from '@jupyterlab/application';
import { ReactWidget, UseSignal } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import {
  notebookIcon,
  refreshIcon,
  ToolbarButtonComponent
} from '@jupyterlab/ui-components';
import * as React from 'react';

import {
  deleteSnapshot,
  IActionContext,
  isSnapshotKernel,
  restoreOffered,
  restoreSnapshot,
  takeVariables
} from '../actions';
import { baseName, formatBytes, formatClock, policyLines } from '../format';
import { snapshotIcon } from '../icons';
import { describeError } from '../request';
import {
  CommandIDs,
  IKernelStatus,
  INotebookTarget,
  IPolicy,
  ISnapshot,
  SNAPSHOT_KERNEL_DISPLAY_NAME,
  SNAPSHOT_KERNEL_NAME
} from '../tokens';
import {
  ActionButton,
  Callout,
  JobProgress,
  ProgressBar,
  StateBadge
} from './common';
import { matchesQuery } from '../contents';
import { Comparison } from './Contents';
import { DeathCallout } from './DeathNotice';
import { SnapshotItem } from './SnapshotItem';
import { CheckpointTimeline } from './Timeline';

export interface ISnapshotViewProps {
  actions: IActionContext;
  /** The app's commands: the buttons on the current notebook execute them
   * (commandsAndMenu.ts), and are enabled when they are. */
  commands: JupyterFrontEnd['commands'];
  /** The notebook panel the model's target is about. */
  currentNotebook: () => NotebookPanel | null;
}

/** The kernel of the current notebook: state, actions, jobs in progress. */
function TargetSection(
  props: ISnapshotViewProps & {
    target: INotebookTarget;
    status: IKernelStatus | null;
  }
): JSX.Element {
  const { actions, commands, target, status } = props;
  const { model } = actions;
  const panel = props.currentNotebook();
  const jobs = model.jobsFor(target.kernelId);
  const snapshotKernel = isSnapshotKernel(model, target);
  const unreachable = model.unreachableSince;
  // What the server said last is not what is now while it cannot be reached.
  const state = unreachable
    ? null
    : status?.snapshots
      ? (status.state ?? 'running')
      : null;
  const death = unreachable ? null : (status?.death ?? null);
  const [pending, setPending] = React.useState(false);

  /** Execute a command on the current notebook (while it runs, the buttons wait). */
  const run = (id: string) => {
    setPending(true);
    void commands
      .execute(id)
      .catch(() => undefined)
      .finally(() => setPending(false));
  };
  const disabled = (id: string) => pending || !commands.isEnabled(id);

  let notice: JSX.Element | null = null;
  if (unreachable) {
    // Said above the panel's content (SnapshotsView): nothing more of the kernel.
  } else if (death && target.kernelId) {
    const kernelId = target.kernelId;
    notice = (
      <DeathCallout
        death={death}
        onRestore={
          panel && death.snapshot_id
            ? () => restoreOffered(actions, panel, kernelId, death)
            : null
        }
        onDismiss={() => model.dismissDeath(kernelId)}
      />
    );
  } else if (!target.kernelId) {
    notice = (
      <Callout kind="warning" title="No kernel">
        <p>
          This notebook has no kernel. Choose "{SNAPSHOT_KERNEL_DISPLAY_NAME}"
          to take snapshots of it.
        </p>
        {panel && <UseKernelButton commands={commands} />}
      </Callout>
    );
  } else if (!snapshotKernel) {
    notice = (
      <Callout kind="warning" title="Not a snapshot kernel">
        <p>
          This notebook's kernel is not a snapshot kernel: choose "
          {SNAPSHOT_KERNEL_DISPLAY_NAME}".
        </p>
        {panel && <UseKernelButton commands={commands} />}
      </Callout>
    );
  } else if (status && !status.snapshots) {
    notice = (
      <Callout kind="error" title="Snapshot wrapper not reachable">
        <p>
          {status.reason || 'The kernel does not answer.'} If the kernel is
          restarting, wait a moment; if it died, restore a snapshot below.
        </p>
      </Callout>
    );
  } else if (state === 'suspended') {
    notice = (
      <Callout kind="info" title="Kernel suspended">
        <p>
          Its memory is saved in a snapshot and its process has ended (GPU
          memory freed). Running a cell resumes it.
        </p>
      </Callout>
    );
  } else if (state === 'dead') {
    notice = (
      <Callout kind="error" title="Kernel process died">
        <p>Restore a snapshot below, or restart the kernel.</p>
      </Callout>
    );
  } else if (status?.closed_on_restore?.length) {
    notice = (
      <Callout kind="info" title="Connections closed">
        <p>
          closed on restore:{' '}
          {status.closed_on_restore
            .map(c => `${c.process} (pid ${c.pid}) ${c.local} -> ${c.remote}`)
            .join(', ')}
        </p>
      </Callout>
    );
  }

  // Names a live process held at the last restore: the kernel has private copies.
  const privateShm =
    state === 'running' && status?.private_shm?.length ? (
      <Callout kind="warning" title="Shared memory not shared">
        <p>
          Another process here holds these /dev/shm names, so the restored
          kernel has private copies:{' '}
          {status.private_shm
            .map(
              f =>
                `${f.name} (held by ${f.held_by
                  .map(h => `${h.process} pid ${h.pid}`)
                  .join(', ')})`
            )
            .join('; ')}
          . A new attach by such a name (SharedMemory(name=...), a new worker)
          reaches that process's memory, not the kernel's.
        </p>
      </Callout>
    ) : null;

  return (
    <section
      className="jp-KernelSnapshots-target"
      aria-label="Current notebook kernel"
    >
      <div className="jp-KernelSnapshots-targetName" title={target.path}>
        <notebookIcon.react tag="span" className="jp-KernelSnapshots-icon" />
        <span className="jp-KernelSnapshots-ellipsis">
          {baseName(target.path)}
        </span>
      </div>
      <div className="jp-KernelSnapshots-kernel">
        <span className="jp-KernelSnapshots-ellipsis">
          {target.kernelId
            ? target.kernelDisplayName || target.kernelName
            : 'No kernel'}
        </span>
        {state && <StateBadge state={state} />}
        {(status?.gpu?.bytes ?? 0) > 0 && (
          <span
            className="jp-KernelSnapshots-badge jp-KernelSnapshots-gpu"
            title={`GPU memory the kernel's processes hold now (${status?.gpu?.processes ?? 0} process(es))`}
          >
            GPU {formatBytes(status?.gpu?.bytes ?? 0)}
          </span>
        )}
        {status?.snapshots &&
          status.snapshot_id &&
          (status.executions_since_snapshot ?? 0) > 0 &&
          state === 'running' && (
            <span
              className="jp-KernelSnapshots-dim"
              title="Cells run since the last snapshot"
            >
              {status.executions_since_snapshot} cell
              {status.executions_since_snapshot === 1 ? '' : 's'} since last
              snapshot
            </span>
          )}
      </div>
      {notice}
      {privateShm}
      {snapshotKernel && panel && (
        <div className="jp-KernelSnapshots-targetActions">
          <ActionButton
            kind="accept"
            className="jp-KernelSnapshots-take"
            disabled={disabled(CommandIDs.snapshot)}
            onClick={() => run(CommandIDs.snapshot)}
            title="Snapshot the kernel now (it keeps running)"
          >
            <snapshotIcon.react
              tag="span"
              className="jp-KernelSnapshots-icon"
            />
            Snapshot kernel
          </ActionButton>
          {state === 'suspended' ? (
            <ActionButton
              disabled={disabled(CommandIDs.resume)}
              onClick={() => run(CommandIDs.resume)}
              title="Bring the kernel back now"
            >
              Resume now
            </ActionButton>
          ) : (
            <ActionButton
              disabled={disabled(CommandIDs.suspend)}
              onClick={() => run(CommandIDs.suspend)}
              title="Snapshot the kernel and end its process (frees its memory and GPU); the next cell brings it back"
            >
              Suspend now
            </ActionButton>
          )}
        </div>
      )}
      {snapshotKernel && panel && status?.checkpoints?.enabled && (
        <div className="jp-KernelSnapshots-targetActions">
          <ActionButton
            disabled={disabled(CommandIDs.undoLastCell)}
            onClick={() => run(CommandIDs.undoLastCell)}
            title="Bring the kernel back to before its last cell"
          >
            Undo last cell
          </ActionButton>
          <ActionButton
            disabled={disabled(CommandIDs.redo)}
            onClick={() => run(CommandIDs.redo)}
            title="Bring the kernel forward to where the last undo began"
          >
            Redo
          </ActionButton>
        </div>
      )}
      {snapshotKernel && (
        <CheckpointTimeline
          actions={actions}
          target={target}
          status={status}
          panel={panel}
          blocked={
            jobs.length > 0
              ? 'A job runs on the notebook’s kernel.'
              : state !== 'running'
                ? 'The kernel is not running.'
                : ''
          }
        />
      )}
      {!unreachable &&
        jobs.map(tracked => (
          <JobProgress key={tracked.job.id} job={tracked.job} />
        ))}
      {jobs.length === 0 &&
        (state === 'restoring' || state === 'snapshotting') && (
          <div className="jp-KernelSnapshots-job" role="status">
            <div className="jp-KernelSnapshots-jobText">
              {state === 'restoring'
                ? 'Bringing the kernel back from its snapshot…'
                : 'Taking a snapshot…'}
            </div>
            <ProgressBar fraction={null} label={state} />
          </div>
        )}
    </section>
  );
}

function UseKernelButton(props: {
  commands: JupyterFrontEnd['commands'];
}): JSX.Element {
  return (
    <ActionButton
      kind="accept"
      onClick={() =>
        void props.commands
          .execute(CommandIDs.useSnapshotKernel)
          .catch(() => undefined)
      }
      title={`Start a "${SNAPSHOT_KERNEL_DISPLAY_NAME}" kernel (kernelspec ${SNAPSHOT_KERNEL_NAME}) for this notebook`}
    >
      Use {SNAPSHOT_KERNEL_DISPLAY_NAME}
    </ActionButton>
  );
}

function PolicyView(props: { policy: IPolicy | null }): JSX.Element | null {
  const { policy } = props;
  if (!policy) {
    return null;
  }
  return (
    <details className="jp-KernelSnapshots-policy">
      <summary>Server policy</summary>
      <dl>
        {policyLines(policy).map(([label, value]) => (
          <React.Fragment key={label}>
            <dt>{label}</dt>
            <dd>{value}</dd>
          </React.Fragment>
        ))}
      </dl>
      <p className="jp-KernelSnapshots-dim">
        Set by the server (SnapshotExtensionApp options); read-only here.
      </p>
    </details>
  );
}

/** The whole panel's content. */
export function SnapshotsView(props: ISnapshotViewProps): JSX.Element {
  const { actions } = props;
  const { model } = actions;
  const target = model.target;
  const status = model.kernelStatus(target?.kernelId);
  const snapshots = model.snapshots;
  const showAll = model.showAll;
  const restoring = target ? model.jobsFor(target.kernelId).length > 0 : false;
  const [query, setQuery] = React.useState('');
  const [compared, setCompared] = React.useState<string[]>([]);
  const shown = snapshots.filter(s => matchesQuery(s, query));
  const takeBlocked = !target?.kernelId
    ? 'Open a notebook with a running kernel to take variables into it.'
    : restoring
      ? 'A job runs on the notebook’s kernel.'
      : '';
  const onTake = (
    snapshot: ISnapshot,
    names: string[],
    rename: { [name: string]: string }
  ) => {
    if (target?.kernelId) {
      void takeVariables(actions, snapshot, target, names, rename);
    }
  };
  const onCompare = (snapshot: ISnapshot) =>
    setCompared(
      compared.includes(snapshot.id)
        ? compared.filter(id => id !== snapshot.id)
        : [...compared, snapshot.id].slice(-2)
    );
  // Older first: the listing is newest first.
  const pair = snapshots.filter(s => compared.includes(s.id)).reverse();

  // Listed for this notebook: restored for it, at its path now (after renames and moves).
  const onRestore = (snapshot: ISnapshot) =>
    void restoreSnapshot(actions, snapshot, {
      confirm: model.settings.confirmRestore,
      path: !showAll && target ? target.path : undefined
    });
  const onDelete = (snapshot: ISnapshot) =>
    void deleteSnapshot(actions, snapshot, {
      confirm: model.settings.confirmDelete
    });

  let list: JSX.Element;
  if (model.error && !model.loaded) {
    const { message, hint } = describeError(model.error);
    list = (
      <Callout kind="error" title="Cannot load the snapshots">
        <p>{message}</p>
        {hint && <p>{hint}</p>}
        <p className="jp-KernelSnapshots-dim">
          Retrying by itself, less and less often.
        </p>
        <ActionButton
          onClick={() =>
            void props.commands
              .execute(CommandIDs.refresh)
              .catch(() => undefined)
          }
        >
          Retry now
        </ActionButton>
      </Callout>
    );
  } else if (!showAll && !target) {
    list = (
      <p className="jp-KernelSnapshots-empty">
        Open a notebook to see the snapshots of its kernel, or show all the
        snapshots in the store.
      </p>
    );
  } else if (!model.loaded) {
    list = <p className="jp-KernelSnapshots-empty">Loading snapshots…</p>;
  } else if (snapshots.length > 0 && shown.length === 0) {
    list = (
      <p className="jp-KernelSnapshots-empty">
        No snapshot holds a variable or ran a cell matching “{query}”.
      </p>
    );
  } else if (snapshots.length === 0) {
    list = (
      <p className="jp-KernelSnapshots-empty">
        {showAll
          ? 'The store holds no snapshots yet.'
          : isSnapshotKernel(model, target)
            ? 'No snapshots of this notebook yet. Take one with "Snapshot kernel" (here, in the notebook toolbar or in the Kernel menu).'
            : 'No snapshots of this notebook.'}
      </p>
    );
  } else {
    // The snapshot the kernel of the notebook descends from (same lineage and sequence).
    const base =
      status?.snapshots && status.lineage
        ? snapshots.find(
            s => s.lineage === status.lineage && s.sequence === status.sequence
          )
        : undefined;
    list = (
      <ul className="jp-KernelSnapshots-list" aria-label="Snapshots">
        {shown.map(snapshot => (
          <SnapshotItem
            key={snapshot.id}
            snapshot={snapshot}
            newest={snapshot === snapshots[0] && !showAll}
            current={
              base === snapshot
                ? (status?.executions_since_snapshot ?? 0)
                : null
            }
            showPath={showAll}
            disabled={restoring}
            onRestore={onRestore}
            onDelete={onDelete}
            model={model}
            compared={compared.includes(snapshot.id)}
            onCompare={onCompare}
            takeBlocked={takeBlocked}
            onTake={onTake}
          />
        ))}
      </ul>
    );
  }

  const unreachable = model.unreachableSince;
  return (
    <div className="jp-KernelSnapshots-body">
      {unreachable && (
        <Callout kind="warning" title="The server cannot be reached">
          <p>
            Since {formatClock(unreachable)}: what its kernels do now is not
            known here. Trying again every few seconds; their state (and an
            offer to restore a kernel that is gone) comes back with the server.
          </p>
        </Callout>
      )}
      {target && <TargetSection {...props} target={target} status={status} />}
      <div className="jp-KernelSnapshots-listHeader">
        <span className="jp-KernelSnapshots-listTitle">
          {showAll ? 'All in the store' : 'This notebook'}
          {model.loaded && snapshots.length > 0 ? ` (${snapshots.length})` : ''}
        </span>
        <label className="jp-KernelSnapshots-switch">
          <input
            type="checkbox"
            role="switch"
            checked={showAll}
            onChange={event => {
              model.showAll = event.currentTarget.checked;
            }}
          />
          <span>Show all</span>
        </label>
      </div>
      {model.error && model.loaded && !unreachable && (
        <Callout kind="error">
          <p>
            Refresh failed: {describeError(model.error).message} (showing the
            last list).
          </p>
        </Callout>
      )}
      {model.storeError && (
        <Callout kind="warning" title="The store cannot be reached">
          <p>{model.storeError}</p>
          <p className="jp-KernelSnapshots-dim">
            Only the snapshots waiting on this server for their upload are
            listed.
          </p>
        </Callout>
      )}
      {model.loaded && snapshots.length > 0 && (
        <input
          type="search"
          className="jp-KernelSnapshots-search"
          placeholder="Find a variable or cell…"
          aria-label="Search snapshots by variable name or cell text"
          value={query}
          onChange={event => setQuery(event.currentTarget.value)}
        />
      )}
      {pair.length === 2 && (
        <Comparison
          key={pair.map(s => s.id).join()}
          model={model}
          older={pair[0].id}
          newer={pair[1].id}
          onClose={() => setCompared([])}
        />
      )}
      {list}
      <PolicyView policy={model.policy} />
    </div>
  );
}

/** The "Kernel Snapshots" side panel, re-rendered when the model changes. */
export class SnapshotsPanel extends ReactWidget {
  constructor(private _props: ISnapshotViewProps) {
    super();
    this.id = 'jp-kernel-snapshots';
    this.addClass('jp-KernelSnapshots');
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'Kernel Snapshots');
    this.title.icon = snapshotIcon;
    this.title.caption = 'Kernel Snapshots';
  }

  render(): JSX.Element {
    const { actions, commands } = this._props;
    const { model } = actions;
    return (
      <>
        <div className="jp-KernelSnapshots-header">
          <h2>Kernel Snapshots</h2>
          <UseSignal signal={model.changed}>
            {() => (
              <ToolbarButtonComponent
                icon={refreshIcon}
                tooltip="Refresh the snapshots"
                className={model.loading ? 'jp-mod-loading' : ''}
                onClick={() =>
                  void commands
                    .execute(CommandIDs.refresh)
                    .catch(() => undefined)
                }
              />
            )}
          </UseSignal>
        </div>
        <div className="jp-KernelSnapshots-content">
          <UseSignal signal={model.changed}>
            {() => <SnapshotsView {...this._props} />}
          </UseSignal>
        </div>
      </>
    );
  }
}
