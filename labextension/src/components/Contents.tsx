import * as React from 'react';

import {
  compareContents,
  describeVariable,
  firstLine,
  lastCellLine,
  shortType
} from '../contents';
import { formatBytes, formatDuration } from '../format';
import { describeError } from '../request';
import type {
  ICellRecord,
  IContents,
  ISnapshot,
  ISnapshotsModel
} from '../tokens';
import { ActionButton } from './common';

/** On a card: the last cell run before the snapshot and its biggest variables. */
export function ContentsSummary(props: {
  contents?: IContents;
}): JSX.Element | null {
  const contents = props.contents;
  if (!contents || Object.keys(contents).length === 0) {
    return null;
  }
  const last = lastCellLine(contents);
  const variables = (contents.variables ?? []).slice(0, 3);
  return (
    <div className="jp-KernelSnapshots-contents">
      {last && (
        <div
          className="jp-KernelSnapshots-lastCell"
          title={`Last cell run before this snapshot (${contents.cells?.length ?? 0} since the previous one)`}
        >
          <code>{last}</code>
        </div>
      )}
      {variables.length > 0 && (
        <ul
          className="jp-KernelSnapshots-topVariables"
          aria-label="Biggest variables"
        >
          {variables.map(v => (
            <li key={v.name} title={`${v.type}: ${describeVariable(v)}`}>
              <strong>{v.name}</strong>{' '}
              <span className="jp-KernelSnapshots-dim">
                {shortType(v.type, contents.language)} {formatBytes(v.size)}
              </span>
            </li>
          ))}
        </ul>
      )}
      {contents.variables_unavailable && (
        <div
          className="jp-KernelSnapshots-dim"
          title={contents.variables_unavailable}
        >
          variables not recorded
        </div>
      )}
      {contents.partial && (
        <div className="jp-KernelSnapshots-dim" title={contents.partial_reason}>
          partial: {contents.partial_reason}
        </div>
      )}
    </div>
  );
}

function CellList(props: { cells: ICellRecord[]; label: string }): JSX.Element {
  return (
    <ol className="jp-KernelSnapshots-cells" aria-label={props.label}>
      {props.cells.map((cell, index) => (
        <li key={index} title={cell.code ?? cell.first_line}>
          <code>
            [{cell.execution_count ?? ' '}] {firstLine(cell)}
          </code>
          <span className="jp-KernelSnapshots-dim">
            {' '}
            {cell.running ? 'running' : formatDuration(cell.seconds ?? 0)}
          </span>
        </li>
      ))}
    </ol>
  );
}

/** Loads a snapshot's full record (listings carry the short form); ``load`` instead of
 * the model's ``details`` (a cell checkpoint's, say). */
function useDetails(
  model: ISnapshotsModel,
  snapshotId: string,
  load?: (id: string) => Promise<ISnapshot>
): { snapshot: ISnapshot | null; error: string } {
  const [state, setState] = React.useState<{
    snapshot: ISnapshot | null;
    error: string;
  }>({
    snapshot: null,
    error: ''
  });
  React.useEffect(() => {
    let live = true;
    (load ?? (id => model.details(id)))(snapshotId).then(
      snapshot => live && setState({ snapshot, error: '' }),
      error =>
        live &&
        setState({ snapshot: null, error: describeError(error).message })
    );
    return () => {
      live = false;
    };
  }, [snapshotId]);
  return state;
}

/**
 * An expanded card: every variable recorded (the 50 biggest) and the cells run since the
 * previous snapshot; chosen variables can be taken back into the notebook's kernel.
 */
export function ContentsDetails(props: {
  model: ISnapshotsModel;
  snapshotId: string;
  /** Why variables cannot be taken now ('' when they can). */
  takeBlocked: string;
  onTake: (names: string[], rename: { [name: string]: string }) => void;
  /** How its record is loaded (default: the model's details of a snapshot). */
  load?: (id: string) => Promise<ISnapshot>;
  /** The title of its cells (default: since the previous snapshot). */
  cellsLabel?: string;
}): JSX.Element {
  const { snapshot, error } = useDetails(
    props.model,
    props.snapshotId,
    props.load
  );
  const [chosen, setChosen] = React.useState<Set<string>>(new Set());
  const [renamed, setRenamed] = React.useState<{ [name: string]: string }>({});
  if (error) {
    return <div className="jp-KernelSnapshots-itemError">{error}</div>;
  }
  if (!snapshot) {
    return <div className="jp-KernelSnapshots-dim">Loading what it holds…</div>;
  }
  const contents = snapshot.contents ?? {};
  const variables = contents.variables ?? [];
  // A kernel other than ipykernel (R, xeus): its variables cannot be taken back.
  const takeable = !contents.take_unavailable;
  const toggle = (name: string) => {
    const next = new Set(chosen);
    if (next.has(name)) {
      next.delete(name);
    } else {
      next.add(name);
    }
    setChosen(next);
  };
  return (
    <div className="jp-KernelSnapshots-details">
      {contents.variables_unavailable ? (
        <p className="jp-KernelSnapshots-unavailable">
          {contents.variables_unavailable}
        </p>
      ) : (
        <div className="jp-KernelSnapshots-detailsTitle">
          Variables: {contents.variable_count ?? variables.length} (
          {formatBytes(contents.variables_bytes ?? 0)})
          {variables.length < (contents.variable_count ?? 0)
            ? `, the ${variables.length} biggest`
            : ''}
        </div>
      )}
      <ul className="jp-KernelSnapshots-variables" aria-label="Variables">
        {variables.map(v => (
          <li key={v.name} className="jp-KernelSnapshots-variable">
            <label className="jp-KernelSnapshots-variableName" title={v.type}>
              {takeable && (
                <input
                  type="checkbox"
                  aria-label={`Take ${v.name}`}
                  checked={chosen.has(v.name)}
                  onChange={() => toggle(v.name)}
                />
              )}
              <strong className="jp-KernelSnapshots-ellipsis">{v.name}</strong>
              <span className="jp-KernelSnapshots-dim">
                {shortType(v.type, contents.language)}
              </span>
            </label>
            <div className="jp-KernelSnapshots-variableInfo">
              {describeVariable(v)}
            </div>
            {chosen.has(v.name) && (
              <input
                className="jp-KernelSnapshots-rename"
                aria-label={`New name for ${v.name}`}
                placeholder={`as ${v.name}, or a new name`}
                value={renamed[v.name] ?? ''}
                onChange={event =>
                  setRenamed({
                    ...renamed,
                    [v.name]: event.currentTarget.value.trim()
                  })
                }
              />
            )}
          </li>
        ))}
      </ul>
      {contents.partial && (
        <p className="jp-KernelSnapshots-dim">
          Partial: {contents.partial_reason}
        </p>
      )}
      {takeable ? (
        <ActionButton
          className="jp-KernelSnapshots-takeVariables"
          disabled={chosen.size === 0 || !!props.takeBlocked}
          title={
            props.takeBlocked ||
            'Copy the chosen variables into the notebook’s kernel (it keeps everything else)'
          }
          onClick={() => {
            const names = [...chosen];
            const rename: { [name: string]: string } = {};
            for (const name of names) {
              if (renamed[name] && renamed[name] !== name) {
                rename[name] = renamed[name];
              }
            }
            props.onTake(names, rename);
          }}
        >
          Take back {chosen.size > 0 ? [...chosen].join(', ') : 'variables'}
        </ActionButton>
      ) : (
        <p className="jp-KernelSnapshots-unavailable">
          {contents.take_unavailable}
        </p>
      )}
      <div className="jp-KernelSnapshots-detailsTitle">
        {props.cellsLabel ?? 'Cells since the previous snapshot'}:{' '}
        {contents.cells?.length ?? 0}
      </div>
      <CellList cells={contents.cells ?? []} label="Cells" />
    </div>
  );
}

/** Two snapshots side by side: variables added, removed, changed; the cells between. */
export function Comparison(props: {
  model: ISnapshotsModel;
  older: string;
  newer: string;
  onClose: () => void;
}): JSX.Element {
  const older = useDetails(props.model, props.older);
  const newer = useDetails(props.model, props.newer);
  let body: JSX.Element;
  if (older.error || newer.error) {
    body = (
      <p className="jp-KernelSnapshots-itemError">
        {older.error || newer.error}
      </p>
    );
  } else if (!older.snapshot || !newer.snapshot) {
    body = <p className="jp-KernelSnapshots-dim">Loading…</p>;
  } else {
    const diff = compareContents(
      older.snapshot.contents ?? {},
      newer.snapshot.contents ?? {}
    );
    const language = newer.snapshot.contents?.language;
    body = (
      <>
        <div className="jp-KernelSnapshots-detailsTitle">
          Added ({diff.added.length})
        </div>
        <ul aria-label="Added">
          {diff.added.map(v => (
            <li key={v.name}>
              <strong>{v.name}</strong> {shortType(v.type, language)}{' '}
              {describeVariable(v)}
            </li>
          ))}
        </ul>
        <div className="jp-KernelSnapshots-detailsTitle">
          Removed ({diff.removed.length})
        </div>
        <ul aria-label="Removed">
          {diff.removed.map(v => (
            <li key={v.name}>
              <strong>{v.name}</strong> {shortType(v.type, language)}{' '}
              {describeVariable(v)}
            </li>
          ))}
        </ul>
        <div className="jp-KernelSnapshots-detailsTitle">
          Changed ({diff.changed.length})
        </div>
        <ul aria-label="Changed">
          {diff.changed.map(change => (
            <li key={change.name}>
              <strong>{change.name}</strong>{' '}
              {change.fields.includes('type')
                ? `${shortType(change.before.type, language)} → ${shortType(change.after.type, language)}`
                : `${describeVariable(change.before)} → ${describeVariable(change.after)}`}
            </li>
          ))}
        </ul>
        <div className="jp-KernelSnapshots-detailsTitle">
          Cells between ({diff.cells.length})
        </div>
        <CellList cells={diff.cells} label="Cells between" />
        {diff.partial && (
          <p className="jp-KernelSnapshots-dim">
            One of them is partial: variables past its summary are not compared.
          </p>
        )}
      </>
    );
  }
  return (
    <section className="jp-KernelSnapshots-comparison" aria-label="Comparison">
      <div className="jp-KernelSnapshots-listHeader">
        <span className="jp-KernelSnapshots-listTitle">Compared</span>
        <ActionButton
          kind="minimal"
          onClick={props.onClose}
          title="Close the comparison"
        >
          Close
        </ActionButton>
      </div>
      {body}
    </section>
  );
}
