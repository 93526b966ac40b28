/**
 * Undo and redo of a notebook's kernel from its cell checkpoints (docs/undo.md): what the
 * undo would do is asked first (the checkpoint, the cells it takes out, the files the
 * kernel holds open that changed since), the dialog says it, then the job runs. The cells
 * it takes out are marked in the notebook (notebooks.ts, from the kernel's status).
 */
import type { NotebookPanel } from '@jupyterlab/notebook';

import {
  IActionContext,
  isSnapshotKernel,
  notebookTarget,
  notifyError,
  notifyKernelChoice
} from './actions';
import { confirmUndo, showErrorDialog } from './dialogs';
import { baseName } from './format';
import type { IJob, IUndo, IUndoTarget } from './tokens';

/**
 * Undo (``target``: a checkpoint, before a cell, or the last cell) or redo the kernel of
 * a notebook, after the dialog if the settings ask for it, or if files changed since,
 * or if it undoes more cells than the one asked for. Resolves with the ended job.
 */
export async function undoNotebook(
  context: IActionContext,
  panel: NotebookPanel,
  target: IUndoTarget,
  redo = false
): Promise<IJob | null> {
  const { model, services } = context;
  const nb = notebookTarget(panel, services);
  const name = baseName(nb.path);
  const what = redo ? 'Redo' : 'Undo';
  if (!nb.kernelId || !isSnapshotKernel(model, nb)) {
    notifyKernelChoice(panel, nb);
    return null;
  }
  let plan: IUndo;
  try {
    plan = await model.previewUndo(nb.kernelId, target, redo);
  } catch (error) {
    notifyError(`${what} in ${name}`, error);
    return null;
  }
  if (plan.problems?.length) {
    await showErrorDialog(`${what} is not possible`, {
      message:
        'Files the kernel had open at that checkpoint are missing or have another size ' +
        `now: ${plan.problems.join('; ')}.`,
      hint: 'Put them back as they were, or go back to a later checkpoint.'
    });
    return null;
  }
  const ask =
    model.settings.confirmUndo ||
    (plan.changed_files?.length ?? 0) > 0 ||
    !plan.exact;
  if (ask && !(await confirmUndo(plan, name, redo))) {
    return null;
  }
  try {
    const tracked = await model.undo(nb.kernelId, target, redo, name);
    const job = await model.waitFor(tracked.job.id);
    void model.refresh().catch(() => undefined);
    if (job.status === 'failed' && job.error) {
      void showErrorDialog(`${what} of ${name} failed`, job.error);
    }
    return job;
  } catch (error) {
    notifyError(`${what} of ${name} failed`, error);
    return null;
  }
}
