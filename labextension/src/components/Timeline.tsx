/**
 * The cell checkpoints of the notebook's kernel as a compact timeline (docs/undo.md):
 * one mark per checkpoint, the kernel's position and the redo point marked; a chosen
 * checkpoint says what it holds and can be gone back to, or have variables taken from it
 * (the take-back of snapshots, components/Contents.tsx).
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import * as React from 'react';

import { IActionContext, takeVariables } from '../actions';
import { describeCells } from '../dialogs';
import {
  formatAbsolute,
  formatBytes,
  formatDuration,
  formatRelative,
  parseDate
} from '../format';
import type {
  ICheckpoint,
  ICheckpointListing,
  IKernelStatus,
  INotebookTarget,
  ISnapshot
} from '../tokens';
import { undoNotebook } from '../undo';
import { ActionButton, Callout, useNow } from './common';
import { ContentsDetails } from './Contents';

/** A checkpoint's mark: the count of the kernel's last cell before it (`[5]`), `start`,
 * or, for the kernel saved as an undo or redo began, that count starred (`[5]*`). */
function markOf(checkpoint: ICheckpoint): string {
  if (checkpoint.kind === 'start') {
    return 'start';
  }
  const last = checkpoint.cells[checkpoint.cells.length - 1];
  const count = last?.execution_count ?? checkpoint.execution_count;
  const mark = count !== null && count !== undefined ? `[${count}]` : '[ ]';
  return checkpoint.kind === 'cell' ? mark : `${mark}*`;
}

function describe(checkpoint: ICheckpoint, now: number): string {
  const created = parseDate(checkpoint.created);
  const what =
    checkpoint.kind === 'start'
      ? 'The kernel before its first cell'
      : checkpoint.kind === 'before-undo'
        ? 'The kernel as an undo began'
        : checkpoint.kind === 'before-redo'
          ? 'The kernel as a redo began'
          : `After ${describeCells(checkpoint.cells)}`;
  const memory = checkpoint.memory ?? {};
  const copy =
    memory.mode === 'incremental'
      ? `${formatBytes(memory.copied_bytes ?? 0)} changed`
      : `full copy (${memory.reason || 'first'})`;
  return (
    `${what}, ${formatRelative(created, now)} (${formatAbsolute(created)}): ${copy}, ` +
    `${formatBytes(checkpoint.own_bytes ?? 0)} on disk, requests waited ` +
    `${formatDuration(checkpoint.pause_seconds ?? 0)}`
  );
}

export function CheckpointTimeline(props: {
  actions: IActionContext;
  target: INotebookTarget;
  status: IKernelStatus | null;
  panel: NotebookPanel | null;
  /** Why the kernel cannot be undone or take variables now ('' when it can). */
  blocked: string;
}): JSX.Element | null {
  const { actions, target, status, panel, blocked } = props;
  const now = useNow();
  const { model } = actions;
  const [chosen, setChosen] = React.useState<string | null>(null);
  const [contents, setContents] = React.useState(false);
  const state = status?.checkpoints;
  const kernelId = target.kernelId;
  if (!state || !kernelId) {
    return null;
  }
  if (!state.enabled) {
    return (
      <section
        className="jp-KernelSnapshots-timelineSection"
        aria-label="Cell checkpoints"
      >
        <Callout kind="info" title="No cell checkpoints (undo) for this kernel">
          <p>{state.reason || 'They are off.'}</p>
        </Callout>
      </section>
    );
  }
  const listing: ICheckpointListing | null = model.checkpointsOf(kernelId);
  const checkpoints = listing?.checkpoints ?? [];
  const selected = checkpoints.find(c => c.id === chosen) ?? null;
  return (
    <section
      className="jp-KernelSnapshots-timelineSection"
      aria-label="Cell checkpoints"
    >
      <div className="jp-KernelSnapshots-detailsTitle">
        Cell checkpoints ({checkpoints.length}){state.taking ? ' …' : ''}
      </div>
      <ol className="jp-KernelSnapshots-timeline" aria-label="Timeline">
        {checkpoints.map(checkpoint => {
          const classes = ['jp-KernelSnapshots-checkpoint'];
          if (checkpoint.id === state.position) {
            classes.push('jp-mod-current');
          }
          if (checkpoint.id === state.redo) {
            classes.push('jp-mod-redo');
          }
          if (checkpoint.id === chosen) {
            classes.push('jp-mod-selected');
          }
          return (
            <li key={checkpoint.id}>
              <button
                className={classes.join(' ')}
                title={describe(checkpoint, now)}
                aria-pressed={checkpoint.id === chosen}
                aria-label={`Checkpoint ${markOf(checkpoint)}`}
                onClick={() => {
                  setChosen(checkpoint.id === chosen ? null : checkpoint.id);
                  setContents(false);
                }}
              >
                {markOf(checkpoint)}
              </button>
            </li>
          );
        })}
      </ol>
      {state.skipped && (
        <p className="jp-KernelSnapshots-dim" title={state.skipped.at}>
          Last checkpoint skipped: {state.skipped.reason}
        </p>
      )}
      {typeof state.paced_seconds === 'number' && (
        <p
          className="jp-KernelSnapshots-dim"
          title="Checkpoints pause the kernel for at most a small share of its time (cell_checkpoint_max_pause_share): the cells run meanwhile share the next one."
        >
          Next checkpoint in {formatDuration(state.paced_seconds)}
        </p>
      )}
      {selected && (
        <div className="jp-KernelSnapshots-checkpointDetails">
          <p>{describe(selected, now)}</p>
          <div className="jp-KernelSnapshots-targetActions">
            <ActionButton
              disabled={!panel || !!blocked || selected.id === state.position}
              title={
                blocked ||
                'Bring the kernel back to this checkpoint (its memory and processes)'
              }
              onClick={() =>
                panel && void undoNotebook(actions, panel, { to: selected.id })
              }
            >
              Back to here
            </ActionButton>
            <ActionButton
              onClick={() => setContents(!contents)}
              title="What it holds; take variables back from it"
            >
              {contents ? 'Hide contents' : 'Contents'}
            </ActionButton>
          </div>
          {contents && (
            <ContentsDetails
              model={model}
              snapshotId={selected.id}
              load={id => model.checkpointDetails(kernelId, id)}
              cellsLabel="Cells since the previous checkpoint"
              takeBlocked={blocked}
              onTake={(names, rename) =>
                void takeVariables(
                  actions,
                  { id: selected.id } as ISnapshot,
                  target,
                  names,
                  rename
                )
              }
            />
          )}
        </div>
      )}
    </section>
  );
}
