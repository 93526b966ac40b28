/**
 * The dialogs of the snapshot flows: each asks or shows one thing and returns the
 * answer; the flows (`actions.ts`) decide what to do with it.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import * as React from 'react';

import {
  baseName,
  formatAbsolute,
  formatBytes,
  formatRelative,
  formatTrigger,
  parseDate
} from './format';
import type { INotebookTarget, ISnapshot } from './tokens';

/** "the snapshot of Untitled.ipynb from 3 min ago (manual, 40.0 MiB)". */
export function describeSnapshot(snapshot: ISnapshot): string {
  const date = parseDate(snapshot.created);
  const size = snapshot.stored_bytes ?? snapshot.total_bytes;
  const name = baseName(snapshot.notebook_path) || 'a kernel';
  return (
    `the snapshot of ${name} from ${formatRelative(date)} ` +
    `(${formatTrigger(snapshot.trigger)}, ${formatBytes(size)}, ${formatAbsolute(date)})`
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
  const body = inPlace
    ? `The kernel of ${name} goes back to ${describeSnapshot(snapshot)}. ` +
      'Everything it holds now (variables, imports, open files) is replaced.'
    : target?.kernelId
      ? `${name} gets a new kernel from ${describeSnapshot(snapshot)}. ` +
        `Its current kernel (${target.kernelDisplayName || target.kernelName}) is shut down.`
      : `${name} gets a kernel restored from ${describeSnapshot(snapshot)}.`;
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

/** Ask whether to delete a snapshot. Resolves true if the user accepts. */
export async function confirmDelete(snapshot: ISnapshot): Promise<boolean> {
  const result = await showDialog({
    title: 'Delete snapshot?',
    body:
      `Delete ${describeSnapshot(snapshot)}? This cannot be undone ` +
      '(data shared with other snapshots stays in the store).',
    buttons: [
      Dialog.cancelButton(),
      Dialog.warnButton({ label: 'Delete', ariaLabel: 'Delete snapshot' })
    ],
    defaultButton: 0
  });
  return result.button.accept;
}
