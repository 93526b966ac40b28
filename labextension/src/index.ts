/**
 * JupyterLab plugins of jupyter-kernel-snapshots:
 *
 * - `:model`    the snapshots model (REST polling + server events), for the others;
 * - `:plugin`   the "Kernel Snapshots" side panel, the commands (toolbar, Kernel menu,
 *               palette), the kernel state next to the kernel status, notifications
 *               and the settings;
 * - `:recovery` the offer to restore a notebook's newest snapshot when it opens without
 *               a kernel (after a node loss).
 */
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, IToolbarWidgetRegistry } from '@jupyterlab/apputils';
import {
  INotebookTracker,
  INotebookWidgetFactory,
  NotebookPanel,
  NotebookWidgetFactory
} from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { Debouncer } from '@lumino/polling';

import {
  IActionContext,
  isSnapshotKernel,
  notebookTarget,
  snapshotNotebook,
  suspendOrResume,
  useSnapshotKernel
} from './actions';
import { KernelStateIndicator } from './components/KernelStateIndicator';
import { SnapshotsPanel } from './components/SnapshotPanel';
import { baseName } from './format';
import { snapshotIcon } from './icons';
import { SnapshotsModel } from './model';
import { connectNotifications } from './notify';
import { offerRestoreOnOpen } from './recovery';
import {
  CommandIDs,
  DEFAULT_SETTINGS,
  ISnapshotSettings,
  ISnapshotsModel,
  PLUGIN_ID,
  SNAPSHOT_KERNEL_DISPLAY_NAME,
  SNAPSHOT_KERNEL_NAME
} from './tokens';

export * from './tokens';
export { SnapshotsModel } from './model';
export { requestAPI, SnapshotAPIError } from './request';

const PANEL_ID = 'jp-kernel-snapshots';

/** Read the settings, falling back to the defaults for anything missing. */
function readSettings(
  settings: ISettingRegistry.ISettings | null
): ISnapshotSettings {
  if (!settings) {
    return { ...DEFAULT_SETTINGS };
  }
  const composite = settings.composite as Partial<ISnapshotSettings>;
  return { ...DEFAULT_SETTINGS, ...composite };
}

/** The snapshots model, shared by the other plugins. */
const modelPlugin: JupyterFrontEndPlugin<ISnapshotsModel> = {
  id: 'jupyter-kernel-snapshots:model',
  description:
    'Snapshots of kernels on this server: REST polling with backoff and server events.',
  autoStart: true,
  provides: ISnapshotsModel,
  activate: (app: JupyterFrontEnd): ISnapshotsModel => {
    return new SnapshotsModel({
      serverSettings: app.serviceManager.serverSettings,
      events: app.serviceManager.events
    });
  }
};

/** Panel, commands, toolbar items, menu entries, notifications, settings. */
const panelPlugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'The Kernel Snapshots panel and the snapshot commands of notebooks.',
  autoStart: true,
  requires: [ISnapshotsModel, INotebookTracker],
  optional: [
    ISettingRegistry,
    ICommandPalette,
    ILayoutRestorer,
    IToolbarWidgetRegistry,
    ILabShell
  ],
  activate: (
    app: JupyterFrontEnd,
    model: ISnapshotsModel,
    tracker: INotebookTracker,
    settingRegistry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    toolbarRegistry: IToolbarWidgetRegistry | null,
    labShell: ILabShell | null
  ): void => {
    const { commands, serviceManager: services, shell } = app;

    const findNotebook = (path: string): NotebookPanel | null =>
      tracker.find(
        panel =>
          panel.context.path === path ||
          services.contents.localPath(panel.context.path) === path
      ) ?? null;

    const actions: IActionContext = {
      model,
      services,
      findNotebook,
      openNotebook: path =>
        void commands
          .execute('docmanager:open', { path })
          .catch(() => undefined)
    };

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

    // The notebook the panel is about: the current one (the last one when the focus
    // moves to something that is not a notebook).
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
        } else if (
          ['restarting', 'autorestarting', 'dead', 'starting', 'idle'].includes(
            status
          )
        ) {
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

    // The side panel.
    const panel = new SnapshotsPanel({
      actions,
      currentNotebook: () => current
    });
    shell.add(panel, 'right', { rank: 600 });
    restorer?.add(panel, PANEL_ID);

    // After an automatic restart (e.g. its process was killed) the kernel announces
    // "starting" and then only answers kernel_info requests, whose status messages
    // JupyterLab does not track: the notebook would show "Starting" until the user runs
    // a cell. For snapshot kernels, ask a harmless question (is_complete) whose
    // busy/idle status JupyterLab does track.
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

    // The kernel state next to the kernel status, in every notebook's toolbar.
    toolbarRegistry?.addFactory<NotebookPanel>(
      'Notebook',
      'snapshotState',
      nbPanel => new KernelStateIndicator(model, nbPanel)
    );

    // Commands.
    const currentPanel = (): NotebookPanel | null =>
      tracker.currentWidget ?? current;
    const isSnapshotNotebook = () => {
      const nb = currentPanel();
      return !!nb && isSnapshotKernel(model, notebookTarget(nb, services));
    };
    const kernelState = () => {
      const nb = currentPanel();
      const id = nb?.sessionContext.session?.kernel?.id;
      const status = model.kernelStatus(id);
      return status?.snapshots ? (status.state ?? 'running') : null;
    };

    commands.addCommand(CommandIDs.snapshot, {
      label: 'Snapshot Kernel',
      caption:
        'Save the whole kernel process (memory, GPU memory) to the snapshot store; the kernel keeps running',
      icon: snapshotIcon,
      isEnabled: () => !!currentPanel()?.sessionContext.session?.kernel,
      execute: async () => {
        const nb = currentPanel();
        if (nb) {
          await snapshotNotebook(actions, nb);
        }
      }
    });
    commands.addCommand(CommandIDs.suspend, {
      label: 'Suspend Kernel Now',
      caption:
        'Snapshot the kernel and end its process (frees its memory and GPU); running a cell resumes it',
      isEnabled: () =>
        isSnapshotNotebook() &&
        kernelState() === 'running' &&
        model.jobsFor(currentPanel()?.sessionContext.session?.kernel?.id)
          .length === 0,
      execute: async () => {
        const nb = currentPanel();
        if (nb) {
          await suspendOrResume(actions, nb, 'suspend');
        }
      }
    });
    commands.addCommand(CommandIDs.resume, {
      label: 'Resume Suspended Kernel',
      caption: 'Bring a suspended kernel back now',
      isEnabled: () => kernelState() === 'suspended',
      execute: async () => {
        const nb = currentPanel();
        if (nb) {
          await suspendOrResume(actions, nb, 'resume');
        }
      }
    });
    commands.addCommand(CommandIDs.openPanel, {
      label: 'Show Kernel Snapshots',
      caption: 'Show the Kernel Snapshots panel',
      execute: () => {
        if (labShell) {
          labShell.activateById(PANEL_ID);
        } else {
          shell.activateById(PANEL_ID);
        }
      }
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
    commands.addCommand(CommandIDs.useSnapshotKernel, {
      label: `Change Kernel to ${SNAPSHOT_KERNEL_DISPLAY_NAME}`,
      isEnabled: () => !!currentPanel(),
      execute: async () => {
        const nb = currentPanel();
        if (nb) {
          await useSnapshotKernel(nb);
        }
      }
    });

    const ours = Object.values(CommandIDs);
    const notify = () => {
      for (const id of ours) {
        commands.notifyCommandChanged(id);
      }
    };
    model.changed.connect(notify);
    tracker.currentChanged.connect(notify);

    if (palette) {
      const category = 'Kernel Snapshots';
      for (const command of ours) {
        palette.addItem({ command, category });
      }
    }

    connectNotifications(model);

    // Settings.
    if (settingRegistry) {
      let first = true;
      void settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const apply = () => {
            const values = readSettings(settings);
            model.settings = values;
            if (first) {
              model.showAll = values.showAllByDefault;
              first = false;
            }
          };
          apply();
          settings.changed.connect(apply);
        })
        .catch(reason => {
          console.error(
            'jupyter-kernel-snapshots: cannot load the settings',
            reason
          );
        });
    }
  }
};

/** Offer to restore the newest snapshot when a notebook opens without a kernel. */
const recoveryPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-kernel-snapshots:recovery',
  description:
    'When a notebook whose kernel is gone is opened, offer to restore its newest snapshot.',
  autoStart: true,
  requires: [ISnapshotsModel, INotebookWidgetFactory],
  activate: (
    app: JupyterFrontEnd,
    model: ISnapshotsModel,
    factory: NotebookWidgetFactory.IFactory
  ): void => {
    factory.widgetCreated.connect((_, panel) => {
      offerRestoreOnOpen(panel, {
        model,
        services: app.serviceManager,
        enabled: () => model.settings.offerRestoreOnOpen,
        openPanel: () =>
          void app.commands.execute(CommandIDs.openPanel).catch(() => undefined)
      });
    });
  }
};

export default [modelPlugin, panelPlugin, recoveryPlugin];
