/**
 * What the panel plugin follows in the open notebooks: which one the panel is about
 * (the model's target) and the status of its kernel.
 */
import type { ServiceManager } from '@jupyterlab/services';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Debouncer } from '@lumino/polling';

import { notebookTarget } from './actions';
import { baseName } from './format';
import { ISnapshotsModel, SNAPSHOT_KERNEL_NAME } from './tokens';

/** Kernel statuses after which the kernel's snapshot state is looked at again. */
const REFRESH_ON_STATUS = [
  'restarting',
  'autorestarting',
  'dead',
  'starting',
  'idle'
];

/**
 * Keep `model.target` on the notebook the panel is about: the current one (the last one
 * when the focus moves to something that is not a notebook). Returns that notebook.
 */
export function followCurrentNotebook(
  model: ISnapshotsModel,
  tracker: INotebookTracker,
  services: ServiceManager.IManager
): () => NotebookPanel | null {
  let current: NotebookPanel | null = null;
  const updateTarget = () => {
    model.target = current ? notebookTarget(current, services) : null;
  };
  const watch = (panel: NotebookPanel | null) => {
    if (panel === current) {
      return;
    }
    if (current) {
      current.sessionContext.kernelChanged.disconnect(updateTarget);
      current.sessionContext.sessionChanged.disconnect(updateTarget);
      current.sessionContext.statusChanged.disconnect(onStatus);
      current.context.pathChanged.disconnect(updateTarget);
      current.disposed.disconnect(onDisposed);
    }
    current = panel;
    if (panel) {
      panel.sessionContext.kernelChanged.connect(updateTarget);
      panel.sessionContext.sessionChanged.connect(updateTarget);
      panel.sessionContext.statusChanged.connect(onStatus);
      panel.context.pathChanged.connect(updateTarget);
      panel.disposed.connect(onDisposed);
    }
    updateTarget();
  };
  const onDisposed = () => watch(tracker.currentWidget);
  let lastStatus = '';
  const refreshSoon = new Debouncer(
    () => model.refresh().catch(() => undefined),
    1000
  );
  const onStatus = (_: unknown, status: string) => {
    // A kernel that restarts, dies, ran a cell or wakes up: look at its snapshot
    // state again (a cell sent to a suspended kernel resumes it: show that at once).
    const kernelId = current?.sessionContext.session?.kernel?.id;
    const suspended = model.kernelStatus(kernelId)?.state === 'suspended';
    if (status !== lastStatus) {
      if (status === 'busy' && suspended) {
        void model.refresh().catch(() => undefined);
      } else if (REFRESH_ON_STATUS.includes(status)) {
        void refreshSoon.invoke();
      }
    }
    lastStatus = status;
    updateTarget();
  };
  tracker.currentChanged.connect((_, panel) => {
    if (panel) {
      watch(panel);
    } else if (current?.isDisposed) {
      watch(null);
    }
  });
  watch(tracker.currentWidget);
  return () => current;
}

/** Name kernels in notifications after their notebook. */
export function labelKernelsByNotebook(
  model: ISnapshotsModel,
  tracker: INotebookTracker
): void {
  model.kernelLabel = kernelId => {
    const panel = kernelId
      ? tracker.find(p => p.sessionContext.session?.kernel?.id === kernelId)
      : undefined;
    return panel
      ? baseName(panel.context.path)
      : kernelId
        ? `kernel ${kernelId.slice(0, 8)}`
        : 'a new kernel';
  };
}

/**
 * After an automatic restart (e.g. its process was killed) the kernel announces
 * "starting" and then only answers kernel_info requests, whose status messages
 * JupyterLab does not track: the notebook would show "Starting" until the user runs
 * a cell. For snapshot kernels, ask a harmless question (is_complete) whose
 * busy/idle status JupyterLab does track.
 */
export function nudgeStartingKernels(tracker: INotebookTracker): void {
  tracker.widgetAdded.connect((_, nbPanel) => {
    let timer = 0;
    nbPanel.sessionContext.statusChanged.connect((sessionContext, status) => {
      window.clearTimeout(timer);
      const kernel = sessionContext.session?.kernel;
      if (
        status !== 'starting' ||
        !kernel ||
        kernel.name !== SNAPSHOT_KERNEL_NAME
      ) {
        return;
      }
      timer = window.setTimeout(() => {
        if (!kernel.isDisposed && kernel.status === 'starting') {
          void kernel.requestIsComplete({ code: '' }).catch(() => undefined);
        }
      }, 2000);
    });
  });
}

/** The class of a cell whose effects are not in its kernel's state (undone). */
export const NOT_IN_STATE_CLASS = 'jp-KernelSnapshots-notInState';

/**
 * Mark the cells an undo took out of their kernel's state (the kernel's status names
 * them; a cell that runs again is unmarked): their outputs stay, shown as not in the
 * kernel's state.
 */
export function markCellsNotInState(
  model: ISnapshotsModel,
  tracker: INotebookTracker
): void {
  const mark = (panel: NotebookPanel) => {
    const kernelId = panel.sessionContext.session?.kernel?.id;
    const marked = new Set(
      model.kernelStatus(kernelId)?.checkpoints?.not_in_state ?? []
    );
    for (const cell of panel.content.widgets) {
      const on = marked.has(cell.model.id);
      cell.toggleClass(NOT_IN_STATE_CLASS, on);
      if (on) {
        cell.node.title =
          "Not in the kernel's state: an undo took this cell's effects out (its output stays). Run it again, or redo.";
      } else if (cell.node.title.startsWith("Not in the kernel's state")) {
        cell.node.title = '';
      }
    }
  };
  const markAll = () => tracker.forEach(mark);
  model.changed.connect(markAll);
  tracker.widgetAdded.connect((_, panel) => {
    panel.content.model?.cells.changed.connect(() => mark(panel));
    mark(panel);
  });
}
