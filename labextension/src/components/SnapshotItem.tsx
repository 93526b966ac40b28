import { Button } from '@jupyterlab/ui-components';
import * as React from 'react';

import {
  baseName,
  formatAbsolute,
  formatBytes,
  formatDuration,
  formatRelative,
  formatStatus,
  formatTrigger,
  gpuModels,
  parseDate
} from '../format';
import type { ISnapshot } from '../tokens';

export interface ISnapshotItemProps {
  snapshot: ISnapshot;
  now: number;
  /** Show which notebook the snapshot belongs to (the "show all" list). */
  showPath: boolean;
  /** Whether this is the newest snapshot of the list. */
  newest: boolean;
  /** Whether a restore or delete is allowed now. */
  disabled: boolean;
  onRestore: (snapshot: ISnapshot) => void;
  onDelete: (snapshot: ISnapshot) => void;
}

/** One snapshot: when, why, how big, where, its status, and Restore/Delete. */
export function SnapshotItem(props: ISnapshotItemProps): JSX.Element {
  const { snapshot, now, showPath, newest, disabled } = props;
  const date = parseDate(snapshot.created);
  const relative = formatRelative(date, now);
  const absolute = formatAbsolute(date);
  const status = snapshot.status || 'complete';
  const stored = snapshot.stored_bytes;
  const gpuBytes = snapshot.gpu_bytes ?? 0;
  const gpuName = gpuBytes > 0 ? gpuModels(snapshot) : '';
  const details = [
    snapshot.total_bytes !== undefined
      ? `Memory image: ${formatBytes(snapshot.total_bytes)}`
      : '',
    snapshot.pause_seconds
      ? `Kernel paused for ${formatDuration(snapshot.pause_seconds)}`
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
      aria-label={`Snapshot from ${relative}, ${formatTrigger(snapshot.trigger)}`}
      data-snapshot-id={snapshot.id}
    >
      <div className="jp-KernelSnapshots-itemHeader">
        <time
          className="jp-KernelSnapshots-time"
          dateTime={snapshot.created}
          title={absolute}
        >
          {relative}
        </time>
        <span
          className={`jp-KernelSnapshots-badge jp-KernelSnapshots-trigger jp-mod-${snapshot.trigger}`}
          title="What took this snapshot"
        >
          {formatTrigger(snapshot.trigger)}
        </span>
        {newest && (
          <span className="jp-KernelSnapshots-badge jp-KernelSnapshots-newest">
            newest
          </span>
        )}
        <span
          className={`jp-KernelSnapshots-status jp-mod-${status}`}
          title={snapshot.error || formatStatus(status)}
        >
          {formatStatus(status)}
        </span>
      </div>
      {showPath && (
        <div
          className="jp-KernelSnapshots-itemPath"
          title={snapshot.notebook_path || 'Not attached to a notebook'}
        >
          {snapshot.notebook_path
            ? baseName(snapshot.notebook_path)
            : 'no notebook'}
          {snapshot.notebook_path &&
            snapshot.notebook_path !== baseName(snapshot.notebook_path) && (
              <span className="jp-KernelSnapshots-dim">
                {' '}
                in{' '}
                {snapshot.notebook_path.slice(
                  0,
                  -baseName(snapshot.notebook_path).length - 1
                )}
              </span>
            )}
        </div>
      )}
      <div className="jp-KernelSnapshots-itemSizes" title={details}>
        {stored !== undefined ? (
          <span>
            <strong>{formatBytes(stored)}</strong> stored
          </span>
        ) : (
          <span>
            <strong>{formatBytes(snapshot.total_bytes)}</strong> on this machine
          </span>
        )}
        {snapshot.new_bytes !== undefined && (
          <span title="Bytes this snapshot added to the store (the rest is shared with other snapshots)">
            {formatBytes(snapshot.new_bytes)} new
          </span>
        )}
        {gpuBytes > 0 ? (
          <span
            className="jp-KernelSnapshots-gpu"
            title={`GPU memory included${gpuName ? ` (${gpuName})` : ''}`}
          >
            GPU {formatBytes(gpuBytes)}
            {gpuName ? ` · ${gpuName}` : ''}
          </span>
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
      </div>
      {status === 'upload-failed' && (
        <div className="jp-KernelSnapshots-itemError" role="alert">
          Upload failed: {snapshot.error || 'unknown error'}. It is kept on this
          machine and retried.
        </div>
      )}
      <div className="jp-KernelSnapshots-itemActions">
        <Button
          small
          className="jp-KernelSnapshots-restore"
          disabled={disabled}
          title={`Restore the kernel to this snapshot (${absolute})`}
          onClick={() => props.onRestore(snapshot)}
        >
          Restore
        </Button>
        <Button
          small
          minimal
          className="jp-KernelSnapshots-delete"
          disabled={disabled}
          title="Delete this snapshot"
          onClick={() => props.onDelete(snapshot)}
        >
          Delete
        </Button>
      </div>
    </li>
  );
}
