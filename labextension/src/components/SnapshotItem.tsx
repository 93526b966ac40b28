import * as React from 'react';

import {
  baseName,
  formatAbsolute,
  formatBytes,
  formatClock,
  formatDuration,
  formatStatus,
  formatTrigger,
  gpuModels,
  parseDate
} from '../format';
import type { ISnapshot, ISnapshotsModel } from '../tokens';
import { ActionButton, RelativeTime, useNow } from './common';
import { ContentsDetails, ContentsSummary } from './Contents';

export interface ISnapshotItemProps {
  snapshot: ISnapshot;
  /** Show which notebook the snapshot belongs to (the "show all" list). */
  showPath: boolean;
  /** Whether this is the newest snapshot of the list. */
  newest: boolean;
  /** Whether the notebook's kernel descends from this snapshot (and how many cells since). */
  current: number | null;
  /** Whether a restore or delete is allowed now. */
  disabled: boolean;
  onRestore: (snapshot: ISnapshot) => void;
  onDelete: (snapshot: ISnapshot) => void;
  model: ISnapshotsModel;
  /** Chosen for a comparison. */
  compared: boolean;
  onCompare: (snapshot: ISnapshot) => void;
  /** Why variables cannot be taken back now ('' when they can). */
  takeBlocked: string;
  onTake: (
    snapshot: ISnapshot,
    names: string[],
    rename: { [name: string]: string }
  ) => void;
}

/** Whether the snapshot copied only what changed since its parent, or all of the
 * kernel's memory (and why). */
function MemoryCopy(props: { snapshot: ISnapshot }): JSX.Element | null {
  const memory = props.snapshot.memory;
  if (!memory?.mode) {
    return null;
  }
  const copied = formatBytes(memory.copied_bytes ?? 0);
  const frozen = memory.frozen_total_seconds
    ? `, kernel frozen ${formatDuration(memory.frozen_total_seconds)}`
    : '';
  if (memory.mode === 'incremental') {
    return (
      <span
        className="jp-KernelSnapshots-memoryCopy jp-mod-incremental"
        title={`Only the memory the kernel wrote since its previous snapshot was copied${frozen}; this snapshot still restores on its own`}
      >
        changes only: {copied}
      </span>
    );
  }
  return (
    <span
      className="jp-KernelSnapshots-memoryCopy jp-mod-full"
      title={`All of the kernel's memory was copied (${memory.reason || 'no reason given'})${frozen}`}
    >
      full copy: {memory.reason || copied}
    </span>
  );
}

/** One snapshot: when, why, how big, where, its status, and Restore/Delete. */
export function SnapshotItem(props: ISnapshotItemProps): JSX.Element {
  const { snapshot, showPath, newest, current, disabled } = props;
  const now = useNow();
  const [expanded, setExpanded] = React.useState(false);
  const date = parseDate(snapshot.created);
  const absolute = formatAbsolute(date);
  const status = snapshot.status || 'complete';
  const store = props.model.policy?.store;
  const local = store !== undefined && store !== 's3';
  const stored = snapshot.stored_bytes;
  const gpuBytes = snapshot.gpu_bytes ?? 0;
  const gpuName = gpuBytes > 0 ? gpuModels(snapshot) : '';
  const path = snapshot.notebook_path_now ?? snapshot.notebook_path ?? '';
  const name = baseName(path);
  const details = [
    snapshot.total_bytes !== undefined
      ? `Memory image (as CRIU wrote it): ${formatBytes(snapshot.total_bytes)}`
      : '',
    snapshot.stored_bytes !== undefined
      ? `In the store (compressed, sharing chunks with other snapshots): ${formatBytes(snapshot.stored_bytes)}`
      : '',
    snapshot.frozen_seconds
      ? `Kernel frozen for ${formatDuration(snapshot.frozen_seconds)}`
      : '',
    snapshot.pause_seconds
      ? `Requests held for ${formatDuration(snapshot.pause_seconds)}`
      : '',
    snapshot.python_version ? `Python ${snapshot.python_version}` : '',
    snapshot.criu_version ? `CRIU ${snapshot.criu_version}` : '',
    snapshot.kernel_release ? `Linux ${snapshot.kernel_release}` : '',
    `Id ${snapshot.id}`
  ]
    .filter(Boolean)
    .join('\n');

  return (
    <li
      className={`jp-KernelSnapshots-item jp-mod-${status}`}
      aria-label={`Snapshot from ${formatClock(date, now)}, ${formatTrigger(snapshot.trigger)}`}
      data-snapshot-id={snapshot.id}
    >
      <div className="jp-KernelSnapshots-itemHeader">
        <RelativeTime
          className="jp-KernelSnapshots-time"
          iso={snapshot.created}
        />
        <span className="jp-KernelSnapshots-dim" title={absolute}>
          {formatClock(date, now)}
        </span>
        <span
          className={`jp-KernelSnapshots-status jp-mod-${status}`}
          title={snapshot.error || formatStatus(status, store)}
        >
          {formatStatus(status, store)}
        </span>
      </div>
      {showPath && (
        <div
          className="jp-KernelSnapshots-itemPath"
          title={path || 'Not attached to a notebook'}
        >
          {name || 'no notebook'}
          {path && path !== name && (
            <span className="jp-KernelSnapshots-dim">
              {' '}
              in {path.slice(0, -name.length - 1)}
            </span>
          )}
        </div>
      )}
      <div className="jp-KernelSnapshots-itemBadges">
        <span
          className={`jp-KernelSnapshots-badge jp-KernelSnapshots-trigger jp-mod-${snapshot.trigger}`}
          title="What took this snapshot"
        >
          {formatTrigger(snapshot.trigger)}
        </span>
        {newest && (
          <span
            className="jp-KernelSnapshots-badge jp-KernelSnapshots-newest"
            title="The newest snapshot of this notebook"
          >
            newest
          </span>
        )}
        {current !== null && (
          <span
            className="jp-KernelSnapshots-badge jp-KernelSnapshots-current"
            title={
              current > 0
                ? `The kernel's state comes from this snapshot, plus ${current} cell${current === 1 ? '' : 's'} run since`
                : "The kernel's state is this snapshot's"
            }
          >
            {current > 0 ? `kernel +${current}` : 'kernel'}
          </span>
        )}
        {gpuBytes > 0 && (
          <span
            className="jp-KernelSnapshots-badge jp-KernelSnapshots-gpu"
            title={`GPU memory included: ${formatBytes(gpuBytes)}${gpuName ? ` on ${gpuName}` : ''}`}
          >
            GPU {formatBytes(gpuBytes)}
          </span>
        )}
      </div>
      <ContentsSummary contents={snapshot.contents} />
      {expanded && (
        <ContentsDetails
          model={props.model}
          snapshotId={snapshot.id}
          takeBlocked={props.takeBlocked}
          onTake={(names, rename) => props.onTake(snapshot, names, rename)}
        />
      )}
      <div className="jp-KernelSnapshots-itemSizes" title={details}>
        <span title="The kernel's memory as CRIU wrote it (what a restore brings back)">
          image <strong>{formatBytes(snapshot.total_bytes)}</strong>
        </span>
        {stored !== undefined ? (
          <span title="What it takes in the store: compressed, and sharing chunks with other snapshots">
            stored as <strong>{formatBytes(stored)}</strong>
          </span>
        ) : (
          <span>not stored yet</span>
        )}
        {snapshot.new_bytes !== undefined && (
          <span title="Bytes this snapshot added to the store (the rest is shared with other snapshots)">
            {formatBytes(snapshot.new_bytes)} new
          </span>
        )}
        {gpuBytes > 0 ? (
          gpuName && (
            <span className="jp-KernelSnapshots-dim" title="GPU model">
              {gpuName}
            </span>
          )
        ) : (
          <span className="jp-KernelSnapshots-dim">no GPU memory</span>
        )}
      </div>
      <div className="jp-KernelSnapshots-itemMeta">
        <span title="The machine the snapshot was taken on">
          on {snapshot.host || 'unknown host'}
        </span>
        {snapshot.dump_seconds ? (
          <span title="How long CRIU took to dump the kernel">
            dumped in {formatDuration(snapshot.dump_seconds)}
          </span>
        ) : null}
        <MemoryCopy snapshot={snapshot} />
      </div>
      {status === 'upload-failed' && (
        <div className="jp-KernelSnapshots-itemError" role="alert">
          {local ? 'Not stored' : 'Upload failed'}:{' '}
          {snapshot.error || 'unknown error'}. Kept in the work directory and
          restorable from there; {local ? 'storing' : 'the upload'} is retried.
        </div>
      )}
      {status === 'uploading' && (
        <div className="jp-KernelSnapshots-itemNote">
          {local
            ? 'Being written into the store; restorable already.'
            : 'On this machine until the upload to the store is done.'}
        </div>
      )}
      <div className="jp-KernelSnapshots-itemActions">
        <ActionButton
          kind="minimal"
          className="jp-KernelSnapshots-expand"
          aria-expanded={expanded}
          title="Every variable recorded and the cells run since the previous snapshot"
          onClick={() => setExpanded(!expanded)}
        >
          {expanded ? 'Less' : 'Contents'}
        </ActionButton>
        <ActionButton
          kind="minimal"
          className={`jp-KernelSnapshots-compare jp-mod-left${props.compared ? ' jp-mod-active' : ''}`}
          aria-pressed={props.compared}
          title="Choose two snapshots to compare what they hold"
          onClick={() => props.onCompare(snapshot)}
        >
          Compare
        </ActionButton>
        <ActionButton
          kind="minimal"
          className="jp-KernelSnapshots-delete"
          disabled={disabled}
          title="Delete this snapshot"
          onClick={() => props.onDelete(snapshot)}
        >
          Delete
        </ActionButton>
        <ActionButton
          kind="accept"
          className="jp-KernelSnapshots-restore"
          disabled={disabled}
          title={`Restore the kernel to this snapshot (${absolute})`}
          onClick={() => props.onRestore(snapshot)}
        >
          Restore
        </ActionButton>
      </div>
    </li>
  );
}
