/**
 * What a snapshot holds (its `contents`): lines to show, search and comparison. The
 * server sends the short form in listings and the full one for a single snapshot
 * (jupyter_ext/core/contents.py does the same for the CLI).
 */
import { formatBytes } from './format';
import type { ICellRecord, IContents, ISnapshot, IVariable } from './tokens';

/** The first non-empty line of a cell. */
export function firstLine(cell: ICellRecord): string {
  if (cell.first_line !== undefined) {
    return cell.first_line;
  }
  const line = (cell.code ?? '').split('\n').find(l => l.trim() !== '');
  return (line ?? '').trimEnd();
}

/** "[12] model.fit(x, y)" for the last cell run before the snapshot. */
export function lastCellLine(contents: IContents | undefined): string {
  const cells = contents?.cells ?? [];
  if (cells.length === 0) {
    return '';
  }
  const cell = cells[cells.length - 1];
  const count = cell.execution_count ?? ' ';
  return `[${count}] ${firstLine(cell)}${cell.running ? ' (running)' : ''}`;
}

/** "float64 1000×3, 23.4 MiB on cuda:0". */
export function describeVariable(variable: IVariable): string {
  const parts: string[] = [];
  if (variable.shape) {
    parts.push(variable.shape.join('×') || 'scalar');
  }
  if (variable.dtype) {
    parts.push(variable.dtype);
  }
  if (variable.length !== undefined) {
    parts.push(`len ${variable.length}`);
  }
  const size = `${variable.estimated ? '~' : ''}${formatBytes(variable.size)}`;
  return `${parts.join(' ')}${parts.length ? ', ' : ''}${size}${
    variable.device ? ` on ${variable.device}` : ''
  }`;
}

/** The type's last dotted part: "pandas.core.frame.DataFrame" -> "DataFrame". */
export function shortType(type: string, language?: string): string {
  // Only Python's types are module-qualified; an R class keeps its dots (data.frame).
  if (language && language.toLowerCase() !== 'python') {
    return type;
  }
  const parts = type.split('.');
  return parts[parts.length - 1] || type;
}

/** Whether a snapshot's variables or cells match a search (case-insensitive). */
export function matchesQuery(snapshot: ISnapshot, query: string): boolean {
  const needle = query.trim().toLowerCase();
  if (!needle) {
    return true;
  }
  const contents = snapshot.contents ?? {};
  const names =
    contents.variable_names ?? (contents.variables ?? []).map(v => v.name);
  if (names.some(name => name.toLowerCase().includes(needle))) {
    return true;
  }
  return (contents.cells ?? []).some(cell =>
    (cell.code ?? cell.first_line ?? '').toLowerCase().includes(needle)
  );
}

export interface IVariableChange {
  name: string;
  before: IVariable;
  after: IVariable;
  fields: string[];
}

export interface IComparison {
  added: IVariable[];
  removed: IVariable[];
  changed: IVariableChange[];
  /** Cells the newer one ran since its previous snapshot. */
  cells: ICellRecord[];
  partial: boolean;
}

const COMPARED: (keyof IVariable)[] = [
  'type',
  'size',
  'shape',
  'dtype',
  'device'
];

/** What changed from `older` to `newer` (full records). */
export function compareContents(
  older: IContents,
  newer: IContents
): IComparison {
  const before = new Map((older.variables ?? []).map(v => [v.name, v]));
  const after = new Map((newer.variables ?? []).map(v => [v.name, v]));
  const changed: IVariableChange[] = [];
  for (const [name, variable] of after) {
    const old = before.get(name);
    if (!old) {
      continue;
    }
    const fields = COMPARED.filter(
      key => JSON.stringify(old[key]) !== JSON.stringify(variable[key])
    );
    if (fields.length > 0) {
      changed.push({ name, before: old, after: variable, fields });
    }
  }
  return {
    added: [...after.values()].filter(v => !before.has(v.name)),
    removed: [...before.values()].filter(v => !after.has(v.name)),
    changed,
    cells: newer.cells ?? [],
    partial: !!(older.partial || newer.partial)
  };
}
