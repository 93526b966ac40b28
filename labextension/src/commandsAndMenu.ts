/**
 * The snapshot commands (toolbar button, Kernel menu, palette), in one place.
 *
 * The toolbar button and the Kernel menu entries are declared in `schema/plugin.json`
 * (`jupyter.lab.toolbars`, `jupyter.lab.menus`); this module registers the commands they
 * name, adds them to the palette and keeps their enabled/toggled state up to date. The
 * panel's buttons execute the same commands and are enabled by them: each command's
 * enablement is written here once.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import type { ICommandPalette } from '@jupyterlab/apputils';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { redoIcon, undoIcon } from '@jupyterlab/ui-components';

import {
  IActionContext,
  isSnapshotKernel,
  notebookTarget,
  snapshotNotebook,
  suspendOrResume,
  useSnapshotKernel
} from './actions';
import { snapshotIcon } from './icons';
import { undoNotebook } from './undo';
import {
  CommandIDs,
  ISnapshotsModel,
  SNAPSHOT_KERNEL_DISPLAY_NAME
} from './tokens';

/** The palette category of the commands. */
const PALETTE_CATEGORY = 'Kernel Snapshots';

/** What the commands act on. */
export interface ICommandsContext {
  /** What the flows need (model, services, notebooks). */
  actions: IActionContext;
  /** The notebook the commands are about (null if none). */
  currentPanel: () => NotebookPanel | null;
  /** Bring the Kernel Snapshots panel to the front. */
  showPanel: () => void;
}

/** Register the snapshot commands. */
export function addCommands(
  app: JupyterFrontEnd,
  context: ICommandsContext
): void {
  const { commands } = app;
  const { actions, currentPanel, showPanel } = context;
  const { model, services } = actions;

  const kernelIdOf = (nb: NotebookPanel | null) =>
    nb?.sessionContext.session?.kernel?.id;
  const isSnapshotNotebook = () => {
    const nb = currentPanel();
    return !!nb && isSnapshotKernel(model, notebookTarget(nb, services));
  };
  const kernelState = () => {
    const status = model.kernelStatus(kernelIdOf(currentPanel()));
    return status?.snapshots ? (status.state ?? 'running') : null;
  };
  /** A job of this panel runs on the current notebook's kernel. */
  const hasJob = () => model.jobsFor(kernelIdOf(currentPanel())).length > 0;
  /** A job runs on it, or it is a snapshot kernel that is not running. */
  const busy = () => {
    const state = kernelState();
    return hasJob() || (!!state && state !== 'running');
  };
  /** Run a flow on the current notebook, if there is one. */
  const onCurrent =
    (flow: (nb: NotebookPanel) => Promise<unknown>) => async () => {
      const nb = currentPanel();
      if (nb) {
        await flow(nb);
      }
    };

  commands.addCommand(CommandIDs.snapshot, {
    label: 'Snapshot Kernel',
    caption:
      'Save the whole kernel process (memory, GPU memory) to the snapshot store; the kernel keeps running',
    icon: snapshotIcon,
    isEnabled: () => !!kernelIdOf(currentPanel()) && !busy(),
    execute: onCurrent(nb => snapshotNotebook(actions, nb))
  });
  commands.addCommand(CommandIDs.suspend, {
    label: 'Suspend Kernel Now',
    caption:
      'Snapshot the kernel and end its process (frees its memory and GPU); running a cell resumes it',
    isEnabled: () =>
      isSnapshotNotebook() && kernelState() === 'running' && !hasJob(),
    execute: onCurrent(nb => suspendOrResume(actions, nb, 'suspend'))
  });
  commands.addCommand(CommandIDs.resume, {
    label: 'Resume Suspended Kernel',
    caption: 'Bring a suspended kernel back now',
    isEnabled: () => kernelState() === 'suspended' && !hasJob(),
    execute: onCurrent(nb => suspendOrResume(actions, nb, 'resume'))
  });
  commands.addCommand(CommandIDs.openPanel, {
    label: 'Show Kernel Snapshots',
    caption: 'Show the Kernel Snapshots panel',
    execute: showPanel
  });
  commands.addCommand(CommandIDs.refresh, {
    label: 'Refresh Kernel Snapshots',
    execute: () => model.refresh().catch(() => undefined)
  });
  commands.addCommand(CommandIDs.toggleShowAll, {
    label: 'Show All Snapshots in the Store',
    isToggled: () => model.showAll,
    execute: () => {
      model.showAll = !model.showAll;
    }
  });
  /** The current notebook's kernel runs, has cell checkpoints, and no job runs on it. */
  const checkpoints = () => {
    const status = model.kernelStatus(kernelIdOf(currentPanel()));
    const usable = kernelState() === 'running' && !hasJob();
    return usable ? (status?.checkpoints ?? null) : null;
  };
  commands.addCommand(CommandIDs.undoLastCell, {
    label: 'Undo Last Cell',
    caption:
      'Bring the kernel back to before its last cell (its cell checkpoint): its memory and processes, not files it wrote; outputs stay',
    icon: undoIcon,
    isEnabled: () => !!checkpoints()?.position,
    execute: onCurrent(nb => undoNotebook(actions, nb, {}))
  });
  /** The cell a context menu was opened on, else the active one. */
  const cellOf = (nb: NotebookPanel) => {
    const hit = app.contextMenuHitTest(node =>
      node.classList.contains('jp-Cell')
    );
    const clicked = hit && nb.content.widgets.find(cell => cell.node === hit);
    return clicked || nb.content.activeCell;
  };
  commands.addCommand(CommandIDs.undoBeforeCell, {
    label: 'Back to Before This Cell',
    caption:
      "Bring the kernel back to before this cell's last run (and every cell after it)",
    isEnabled: () => !!checkpoints()?.position,
    execute: onCurrent(nb => {
      const cell = cellOf(nb);
      return cell
        ? undoNotebook(actions, nb, { before_cell: cell.model.id })
        : Promise.resolve(null);
    })
  });
  commands.addCommand(CommandIDs.redo, {
    label: 'Redo Cells (Back to Where the Undo Began)',
    caption: 'Bring the kernel forward to where the last undo began',
    icon: redoIcon,
    isEnabled: () => !!checkpoints()?.redo,
    execute: onCurrent(nb => undoNotebook(actions, nb, {}, true))
  });
  commands.addCommand(CommandIDs.useSnapshotKernel, {
    label: `Change Kernel to ${SNAPSHOT_KERNEL_DISPLAY_NAME}`,
    isEnabled: () => !!currentPanel(),
    execute: onCurrent(nb => useSnapshotKernel(nb))
  });
}

/** Re-evaluate the commands' state whenever the model or the current notebook changes. */
export function updateCommandsOnChange(
  commands: JupyterFrontEnd['commands'],
  model: ISnapshotsModel,
  tracker: INotebookTracker
): void {
  const notify = () => {
    for (const id of Object.values(CommandIDs)) {
      commands.notifyCommandChanged(id);
    }
  };
  model.changed.connect(notify);
  tracker.currentChanged.connect(notify);
}

/** Add every snapshot command to the palette. */
export function addCommandsToPalette(palette: ICommandPalette): void {
  for (const command of Object.values(CommandIDs)) {
    palette.addItem({ command, category: PALETTE_CATEGORY });
  }
}
