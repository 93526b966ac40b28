/**
 * The snapshot commands and the panel's buttons: when each command is enabled (written
 * once, in commandsAndMenu.ts), and that the panel's buttons execute the commands and are
 * enabled when they are. A real command registry and model, against the stub server.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ServiceManager } from '@jupyterlab/services';
import { CommandRegistry } from '@lumino/commands';
import { ReactWidget } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import * as React from 'react';

import { IActionContext, notebookTarget } from '../actions';
import { addCommands } from '../commandsAndMenu';
import { undoDialogBody } from '../dialogs';
import { SnapshotsView } from '../components/SnapshotPanel';
import { SnapshotsModel } from '../model';
import {
  CommandIDs,
  IJob,
  IKernelStatus,
  IUndo,
  SNAPSHOT_KERNEL_NAME
} from '../tokens';
import { StubServer } from './stubServer';

/** What the commands and the panel read of a notebook panel. */
function notebook(kernelName = SNAPSHOT_KERNEL_NAME): NotebookPanel {
  return {
    sessionContext: {
      session: { kernel: { id: 'k1', name: kernelName } },
      kernelDisplayName: 'Python 3 (snapshots)'
    },
    context: { path: 'a.ipynb' }
  } as unknown as NotebookPanel;
}

const services = {
  contents: { localPath: (path: string) => path }
} as unknown as ServiceManager.IManager;

function runningJob(): IJob {
  return {
    id: 'j1',
    kind: 'snapshot',
    kernel_id: 'k1',
    status: 'running',
    phase: 'dumping',
    done_bytes: 0,
    total_bytes: 0,
    started: 0,
    finished: null,
    result: null,
    error: null
  };
}

describe('snapshot commands', () => {
  let server: StubServer;
  let model: SnapshotsModel;
  let commands: CommandRegistry;
  let panel: NotebookPanel | null;
  let actions: IActionContext;

  /** A model that knows kernel k1 with this status, and the commands on it. */
  const setUp = async (status: Partial<IKernelStatus> | null) => {
    server = new StubServer();
    server.on('GET', 'kernels', {
      body: {
        kernels: status ? [{ kernel_id: 'k1', ...status }] : []
      }
    });
    server.on('GET', 'policy', { body: { store: 'local' } });
    server.routes.push(request =>
      request.method === 'GET' ? { body: { snapshots: [] } } : undefined
    );
    model = new SnapshotsModel({
      serverSettings: server.settings,
      auto: false,
      standby: 'never'
    });
    commands = new CommandRegistry();
    actions = {
      model,
      services,
      findNotebook: () => panel,
      findNotebookOf: () => panel,
      openNotebook: () => undefined
    };
    addCommands({ commands } as unknown as JupyterFrontEnd, {
      actions,
      currentPanel: () => panel,
      showPanel: () => undefined
    });
    await model.refresh();
  };

  const enabled = () => ({
    snapshot: commands.isEnabled(CommandIDs.snapshot),
    suspend: commands.isEnabled(CommandIDs.suspend),
    resume: commands.isEnabled(CommandIDs.resume)
  });

  beforeEach(() => {
    panel = notebook();
  });

  afterEach(() => {
    model?.dispose();
  });

  it('a running snapshot kernel: snapshot and suspend', async () => {
    await setUp({ snapshots: true, state: 'running' });
    expect(enabled()).toEqual({ snapshot: true, suspend: true, resume: false });
  });

  it('a job on the kernel: none (until it ends)', async () => {
    await setUp({ snapshots: true, state: 'running' });
    model.track(runningJob());
    expect(enabled()).toEqual({
      snapshot: false,
      suspend: false,
      resume: false
    });
  });

  it('a suspended kernel: resume only', async () => {
    await setUp({ snapshots: true, state: 'suspended' });
    expect(enabled()).toEqual({
      snapshot: false,
      suspend: false,
      resume: true
    });
    model.track(runningJob());
    expect(enabled().resume).toBe(false);
  });

  it('another kernel: snapshot, which offers the snapshot kernel', async () => {
    panel = notebook('python3');
    await setUp({ snapshots: false });
    expect(enabled()).toEqual({
      snapshot: true,
      suspend: false,
      resume: false
    });
  });

  it('no notebook: none', async () => {
    panel = null;
    await setUp({ snapshots: true, state: 'running' });
    expect(enabled()).toEqual({
      snapshot: false,
      suspend: false,
      resume: false
    });
  });

  const undoable = () => ({
    undo: commands.isEnabled(CommandIDs.undoLastCell),
    redo: commands.isEnabled(CommandIDs.redo)
  });

  it('undo once the kernel has a checkpoint, redo once an undo began', async () => {
    const checkpoints = { enabled: true, position: 'c1', redo: null };
    await setUp({ snapshots: true, state: 'running', checkpoints });
    expect(undoable()).toEqual({ undo: true, redo: false });
    await setUp({
      snapshots: true,
      state: 'running',
      checkpoints: { ...checkpoints, redo: 'c2' }
    });
    expect(undoable()).toEqual({ undo: true, redo: true });
    model.track(runningJob());
    expect(undoable()).toEqual({ undo: false, redo: false });
  });

  it('no undo without checkpoints (off, or none yet)', async () => {
    await setUp({
      snapshots: true,
      state: 'running',
      checkpoints: { enabled: false, reason: 'the kernel uses the GPU' }
    });
    expect(undoable()).toEqual({ undo: false, redo: false });
    await setUp({ snapshots: true, state: 'running' });
    expect(undoable()).toEqual({ undo: false, redo: false });
  });
});

describe('the panel on the current notebook, and the undo dialog', () => {
  let widget: ReactWidget;

  beforeAll(() => {
    // React's act() flushes the renders and effects of what it wraps.
    (
      globalThis as { IS_REACT_ACT_ENVIRONMENT?: boolean }
    ).IS_REACT_ACT_ENVIRONMENT = true;
  });

  afterEach(async () => {
    // Unmounting renders too: inside act(), as the mounting.
    await React.act(async () => widget.dispose());
  });

  /** The view on notebook a.ipynb, whose kernel k1 has this status. */
  const render = async (
    status: Partial<IKernelStatus>,
    commands = new CommandRegistry()
  ): Promise<SnapshotsModel> => {
    const server = new StubServer();
    server.on('GET', 'kernels', {
      body: { kernels: [{ kernel_id: 'k1', ...status }] }
    });
    server.routes.push(request =>
      request.method === 'GET' ? { body: { snapshots: [] } } : undefined
    );
    const model = new SnapshotsModel({
      serverSettings: server.settings,
      auto: false,
      standby: 'never'
    });
    await model.refresh();
    const panel = notebook();
    model.target = notebookTarget(panel, services);
    const actions: IActionContext = {
      model,
      services,
      findNotebook: () => panel,
      findNotebookOf: () => panel,
      openNotebook: () => undefined
    };
    widget = ReactWidget.create(
      <SnapshotsView
        actions={actions}
        commands={commands}
        currentNotebook={() => panel}
      />
    );
    await React.act(async () => {
      Widget.attach(widget, document.body);
      await widget.renderPromise;
    });
    return model;
  };

  it('says which /dev/shm names another process holds after a restore', async () => {
    const model = await render({
      snapshots: true,
      state: 'running',
      private_shm: [
        { name: 'psm_1', held_by: [{ pid: 42, process: 'python' }] },
        {
          name: 'psm_2',
          held_by: [
            { pid: 7, process: 'worker' },
            { pid: 8, process: 'worker' }
          ]
        }
      ]
    });
    const text = widget.node.textContent ?? '';
    expect(text).toContain('Shared memory not shared');
    expect(text).toContain(
      'psm_1 (held by python pid 42); psm_2 (held by worker pid 7, worker pid 8)'
    );
    expect(text).toContain("reaches that process's memory, not the kernel's");
    model.dispose();
  });

  it('says nothing of shared memory when no name is held', async () => {
    const model = await render({
      snapshots: true,
      state: 'running',
      private_shm: []
    });
    expect(widget.node.textContent).not.toContain('Shared memory');
    model.dispose();
  });

  it("shows the kernel's cell checkpoints as a timeline, or why it has none", async () => {
    const model = await render({
      snapshots: true,
      state: 'running',
      checkpoints: { enabled: false, reason: 'the kernel uses the GPU' }
    });
    expect(widget.node.textContent).toContain(
      'No cell checkpoints (undo) for this kernel'
    );
    expect(widget.node.textContent).toContain('the kernel uses the GPU');
    model.dispose();
  });

  it('executes the commands and is enabled by them', async () => {
    // The real registry, with commands that say when they ran.
    const executed: string[] = [];
    const commands = new CommandRegistry();
    const enabled = new Set([CommandIDs.snapshot, CommandIDs.resume]);
    for (const id of [CommandIDs.snapshot, CommandIDs.suspend]) {
      commands.addCommand(id, {
        execute: () => {
          executed.push(id);
        },
        isEnabled: () => enabled.has(id)
      });
    }
    const model = await render({ snapshots: true, state: 'running' }, commands);
    const button = (name: string) =>
      Array.from(widget.node.querySelectorAll('button')).find(b =>
        b.textContent?.includes(name)
      ) as HTMLButtonElement;
    expect(button('Snapshot kernel').disabled).toBe(false);
    expect(button('Suspend now').disabled).toBe(true); // its command is disabled
    await React.act(async () => button('Snapshot kernel').click());
    expect(executed).toEqual([CommandIDs.snapshot]);
    model.dispose();
  });

  const shown = async (plan: IUndo, redo = false): Promise<string> => {
    widget = ReactWidget.create(undoDialogBody(plan, 'a.ipynb', redo));
    await React.act(async () => {
      Widget.attach(widget, document.body);
      await widget.renderPromise;
    });
    return widget.node.textContent ?? '';
  };

  const PLAN: IUndo = {
    target: 'c2',
    undone: [
      { cell_id: 'b', execution_count: 3 },
      { cell_id: 'a', execution_count: 2 }
    ],
    not_in_state: ['b', 'a'],
    exact: true,
    save: true,
    outside_world:
      'Undo brings back the kernel, not the world outside it: files the cells wrote stay.'
  };

  it('says the cells it takes out, the outside world once, and the files changed since', async () => {
    const text = await shown({
      ...PLAN,
      changed_files: [
        { path: '/data/out.log', change: 'written', was: 1024, size: 3072 },
        { path: '/data/gone.csv', change: 'removed', was: null, size: null }
      ]
    });
    expect(text).toContain('goes back');
    expect(text).toContain('Cells [3] [2] are taken out of its state');
    expect(text.split('the world outside it').length).toBe(2); // said once
    const files = widget.node.querySelector(
      'ul[aria-label="Files changed since"]'
    );
    expect(
      Array.from(files?.querySelectorAll('li') ?? []).map(li => li.textContent)
    ).toEqual([
      '/data/out.log (written: 1.0 KiB then, 3.0 KiB now)',
      '/data/gone.csv (removed)'
    ]);
  });

  it('lists no files where none changed, and says a batch goes too', async () => {
    const text = await shown({ ...PLAN, exact: false, changed_files: [] });
    expect(widget.node.querySelector('ul')).toBeNull();
    expect(text).toContain('the cells run just before it go too');
  });
});
