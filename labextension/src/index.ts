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

import { IActionContext } from './actions';
import {
  addCommands,
  addCommandsToPalette,
  updateCommandsOnChange
} from './commandsAndMenu';
import { DeathNotice } from './components/DeathNotice';
import { KernelStateIndicator } from './components/KernelStateIndicator';
import { SnapshotsPanel } from './components/SnapshotPanel';
import { SnapshotsModel } from './model';
import {
  followCurrentNotebook,
  labelKernelsByNotebook,
  markCellsNotInState,
  nudgeStartingKernels
} from './notebooks';
import { connectNotifications } from './notify';
import {
  dropLostSessions,
  offerRestoreOnLoss,
  offerRestoreOnOpen
} from './recovery';
import { applySettings } from './settings';
import { CommandIDs, ISnapshotsModel, PLUGIN_ID } from './tokens';

export * from './tokens';
export { SnapshotsModel } from './model';
export { requestAPI, SnapshotAPIError } from './request';

const PANEL_ID = 'jp-kernel-snapshots';

/** The snapshots model, shared by the other plugins. */
const modelPlugin: JupyterFrontEndPlugin<ISnapshotsModel> = {
  id: 'jupyter-kernel-snapshots:model',
  description:
    'Snapshots of kernels on this server: REST polling with backoff and server events.',
  autoStart: true,
  provides: ISnapshotsModel,
  activate: (app: JupyterFrontEnd): ISnapshotsModel => {
    const model = new SnapshotsModel({
      serverSettings: app.serviceManager.serverSettings,
      events: app.serviceManager.events
    });
    // JupyterLab's own word that the server cannot be reached: the panel says so at once.
    app.serviceManager.connectionFailure.connect(() => model.connectionLost());
    return model;
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
    const actions: IActionContext = {
      model,
      services,
      findNotebook: path =>
        tracker.find(
          panel =>
            panel.context.path === path ||
            services.contents.localPath(panel.context.path) === path
        ) ?? null,
      findNotebookOf: snapshot =>
        tracker.find(panel => {
          const kernelId = panel.sessionContext.session?.kernel?.id;
          const status = model.kernelStatus(kernelId);
          return (
            !!kernelId &&
            (kernelId === snapshot.kernel_id ||
              (!!status?.lineage && status.lineage === snapshot.lineage))
          );
        }) ?? null,
      openNotebook: path =>
        void commands
          .execute('docmanager:open', { path })
          .catch(() => undefined)
    };

    labelKernelsByNotebook(model, tracker);
    markCellsNotInState(model, tracker);
    const current = followCurrentNotebook(model, tracker, services);

    const panel = new SnapshotsPanel({
      actions,
      commands,
      currentNotebook: current
    });
    shell.add(panel, 'right', { rank: 600 });
    restorer?.add(panel, PANEL_ID);

    nudgeStartingKernels(tracker);
    // A kernel that died says so at the top of its notebook, with its snapshot offered.
    tracker.widgetAdded.connect((_, nbPanel) => {
      nbPanel.contentHeader.addWidget(new DeathNotice(actions, nbPanel));
    });
    // The kernel state next to the kernel status, in every notebook's toolbar.
    toolbarRegistry?.addFactory<NotebookPanel>(
      'Notebook',
      'snapshotState',
      nbPanel => new KernelStateIndicator(model, nbPanel)
    );

    addCommands(app, {
      actions,
      currentPanel: () => tracker.currentWidget ?? current(),
      showPanel: () => (labShell ?? shell).activateById(PANEL_ID)
    });
    updateCommandsOnChange(commands, model, tracker);
    if (palette) {
      addCommandsToPalette(palette);
    }

    connectNotifications(model);
    if (settingRegistry) {
      applySettings(model, settingRegistry);
    }
  }
};

/** Offer to restore the newest snapshot when a notebook opens without a kernel. */
const recoveryPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-kernel-snapshots:recovery',
  description:
    'When a notebook whose kernel is gone is opened, offer to restore its newest snapshot.',
  autoStart: true,
  requires: [ISnapshotsModel, INotebookWidgetFactory, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    model: ISnapshotsModel,
    factory: NotebookWidgetFactory.IFactory,
    tracker: INotebookTracker
  ): void => {
    const options = {
      model,
      services: app.serviceManager,
      enabled: () => model.settings.offerRestoreOnOpen,
      openPanel: () =>
        void app.commands.execute(CommandIDs.openPanel).catch(() => undefined)
    };
    factory.widgetCreated.connect((_, panel) => {
      offerRestoreOnOpen(panel, options);
      offerRestoreOnLoss(panel, options);
    });
    // The server is back: the notebooks whose kernels it lost say so now.
    model.reconnected.connect(
      () =>
        void dropLostSessions(tracker, app.serviceManager).catch(error =>
          console.warn(
            'kernel snapshots: looking for lost sessions failed',
            error
          )
        )
    );
  }
};

export default [modelPlugin, panelPlugin, recoveryPlugin];
