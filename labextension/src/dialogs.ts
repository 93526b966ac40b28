/**
 * The dialogs of the snapshot flows: each asks or shows one thing and returns the
 * answer; the flows (`actions.ts`) decide what to do with it.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import * as React from 'react';

import { RelativeTime } from './components/common';
import {
  baseName,
  formatBytes,
  formatClock,
  formatRelative,
  formatSizes,
  formatTrigger,
  parseDate
} from './format';
import type {
  ICheckpointCell,
  INotebookTarget,
  ISnapshot,
  IUndo
} from './tokens';

/**
 * "the snapshot of Untitled.ipynb from 3 min ago (22:13, manual, image 40.0 MiB)", its
 * relative time ticking with the page's clock (components/common.tsx).
 */
export function describeSnapshot(snapshot: ISnapshot): React.ReactElement {
  const then = baseName(snapshot.notebook_path);
  const now = baseName(snapshot.notebook_path_now ?? snapshot.notebook_path);
  const name = now
    ? `${now}${then && then !== now ? ` (then ${then})` : ''}`
    : 'a kernel';
  return React.createElement(
    React.Fragment,
    null,
    `the snapshot of ${name} from `,
    React.createElement(RelativeTime, { iso: snapshot.created }),
    ` (${formatClock(parseDate(snapshot.created))}, ${formatTrigger(snapshot.trigger)}, ` +
      `${formatSizes(snapshot)})`
  );
}

/** Show an error with its message, hint and CRIU log (if any). */
export function showErrorDialog(
  title: string,
  error: { message?: string; hint?: string; log_excerpt?: string }
): Promise<unknown> {
  const body = React.createElement(
    'div',
    { className: 'jp-KernelSnapshots-errorDetails' },
    React.createElement('p', null, error.message || 'Unknown error.'),
    error.hint
      ? React.createElement(
          'p',
          null,
          React.createElement('strong', null, 'What to do: '),
          error.hint
        )
      : null,
    error.log_excerpt
      ? React.createElement('pre', null, error.log_excerpt)
      : null
  );
  return showDialog({ title, body, buttons: [Dialog.okButton()] });
}

/**
 * Ask whether to restore a snapshot for a notebook; says what happens to the notebook's
 * kernel. Resolves true if the user accepts.
 *
 * @param name - the notebook's name ('a new kernel' if none)
 * @param target - the open notebook (null if it is not open)
 * @param inPlace - whether the notebook's own kernel goes back to the snapshot
 */
export async function confirmRestore(
  snapshot: ISnapshot,
  name: string,
  target: INotebookTarget | null,
  inPlace: boolean
): Promise<boolean> {
  const what = describeSnapshot(snapshot);
  const body = React.createElement(
    'p',
    null,
    ...(inPlace
      ? [
          `The kernel of ${name} goes back to `,
          what,
          '. Everything it holds now (variables, imports, open files) is replaced.'
        ]
      : target?.kernelId
        ? [
            `${name} gets a new kernel from `,
            what,
            `. Its current kernel (${target.kernelDisplayName || target.kernelName}) is shut down.`
          ]
        : [`${name} gets a kernel restored from `, what, '.'])
  );
  const result = await showDialog({
    title: 'Restore snapshot?',
    body,
    buttons: [
      Dialog.cancelButton(),
      Dialog.warnButton({ label: 'Restore', ariaLabel: 'Restore snapshot' })
    ],
    defaultButton: 1
  });
  return result.button.accept;
}

/**
 * Ask whether variables taken back may replace those of the same names the notebook's
 * kernel has (`message`: the server's, naming them). Resolves true to replace them.
 */
export async function confirmOverwrite(
  notebook: string,
  message: string
): Promise<boolean> {
  const result = await showDialog({
    title: 'Replace variables?',
    body: React.createElement(
      'p',
      null,
      `${message.replace('The kernel', `The kernel of ${notebook}`)} ` +
        'Replace them with the snapshot’s, or cancel (and take them under a new name).'
    ),
    buttons: [
      Dialog.cancelButton(),
      Dialog.warnButton({
        label: 'Replace',
        ariaLabel: 'Replace the variables'
      })
    ],
    defaultButton: 0
  });
  return result.button.accept;
}

/** Ask whether to delete a snapshot. Resolves true if the user accepts. */
export async function confirmDelete(snapshot: ISnapshot): Promise<boolean> {
  const result = await showDialog({
    title: 'Delete snapshot?',
    body: React.createElement(
      'p',
      null,
      'Delete ',
      describeSnapshot(snapshot),
      '? This cannot be undone (data shared with other snapshots stays in the store).'
    ),
    buttons: [
      Dialog.cancelButton(),
      Dialog.warnButton({ label: 'Delete', ariaLabel: 'Delete snapshot' })
    ],
    defaultButton: 0
  });
  return result.button.accept;
}

/** "[7] [6]": cells as the notebook numbers them. */
export function describeCells(cells: ICheckpointCell[]): string {
  return cells.map(cell => `[${cell.execution_count ?? ' '}]`).join(' ');
}

/**
 * What the undo (redo) dialog says: which cells it takes out of the kernel's state (their
 * outputs stay, marked), what it does not bring back (said once: files, rows, messages),
 * and the files the kernel holds open that changed since.
 */
export function undoDialogBody(
  plan: IUndo,
  name: string,
  redo: boolean
): React.ReactElement {
  const when = plan.checkpoint
    ? ` (its checkpoint from ${formatRelative(parseDate(plan.checkpoint.created))})`
    : '';
  const cells = describeCells(plan.undone);
  const lines: React.ReactNode[] = [
    redo
      ? `The kernel of ${name} goes forward to where the undo began${when}.`
      : `The kernel of ${name} goes back${when}, before ${cells || 'no cell'}.`,
    cells
      ? `Cells ${cells} are taken out of its state: their outputs stay, marked as not in the kernel's state. Its execution count goes on.`
      : 'No cell is taken out of its state.'
  ];
  if (!plan.exact) {
    lines.push(
      'No checkpoint was taken right before that cell (cells run in one batch, or a checkpoint skipped): the cells run just before it go too.'
    );
  }
  lines.push(plan.outside_world ?? '');
  const changed = plan.changed_files ?? [];
  return React.createElement(
    'div',
    { className: 'jp-KernelSnapshots-undoDialog' },
    ...lines
      .filter(Boolean)
      .map((line, i) => React.createElement('p', { key: i }, line)),
    changed.length > 0
      ? React.createElement(
          'div',
          { key: 'files' },
          React.createElement(
            'p',
            null,
            React.createElement(
              'strong',
              null,
              'Files the kernel holds open that changed since (undo leaves them as they are now):'
            )
          ),
          React.createElement(
            'ul',
            { 'aria-label': 'Files changed since' },
            ...changed.map(file =>
              React.createElement(
                'li',
                { key: file.path },
                `${file.path} (${file.change}${
                  file.size !== null && file.was !== null
                    ? `: ${formatBytes(file.was)} then, ${formatBytes(file.size)} now`
                    : ''
                })`
              )
            )
          )
        )
      : null
  );
}

/** Ask whether to undo (or redo), saying :func:`undoDialogBody`; true on "Undo". */
export async function confirmUndo(
  plan: IUndo,
  name: string,
  redo: boolean
): Promise<boolean> {
  const result = await showDialog({
    title: redo ? 'Redo?' : 'Undo cells?',
    body: undoDialogBody(plan, name, redo),
    buttons: [
      Dialog.cancelButton(),
      Dialog.warnButton({
        label: redo ? 'Redo' : 'Undo',
        ariaLabel: redo ? 'Redo' : 'Undo cells'
      })
    ],
    defaultButton: 1
  });
  return result.button.accept;
}
