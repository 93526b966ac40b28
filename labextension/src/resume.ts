/**
 * A cell that was running when its kernel was snapshotted keeps running after a restore,
 * but the JupyterLab that sent it is gone (another node, a server that died, or a kernel
 * connection whose futures were dropped when the old kernel died): its messages would
 * reach no cell. The restored kernel says which request goes on (`resumed_request`:
 * message id, cell id, execution count); this follows that request by its message id and
 * shows it in its own cell: running ("[*]"), its new outputs, and its execution count
 * when it ends. Only the notebook the kernel was restored into is touched.
 */
import type { ICodeCellModel } from '@jupyterlab/cells';
import type * as nbformat from '@jupyterlab/nbformat';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { Kernel, KernelMessage } from '@jupyterlab/services';

import type { IRunningRequest, ISnapshotsModel } from './tokens';

/** Follows one resumed request in its cell until it ends. */
export class ResumedCell {
  private constructor(
    private readonly _panel: NotebookPanel,
    private readonly _request: IRunningRequest,
    private readonly _cell: ICodeCellModel
  ) {
    const sessionContext = _panel.sessionContext;
    sessionContext.iopubMessage.connect(this._onIOPub, this);
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    sessionContext.connectionStatusChanged.connect(this._onConnection, this);
    sessionContext.statusChanged.connect(this._onStatus, this);
    _panel.disposed.connect(this.dispose, this);
    this._watchKernel(sessionContext.session?.kernel ?? null);
    _cell.executionState = 'running';
  }

  /**
   * Start following `request` in its cell of `panel` (by the cell id JupyterLab sent
   * with it). Null when the notebook has no such code cell (it was run from elsewhere,
   * or the notebook was not saved with its cell ids): then nothing is shown.
   *
   * Call it before the notebook connects to the restored kernel, so that no message of
   * the request is missed (or pass what an `IOPubRecorder` got meanwhile as `recorded`),
   * then `check` once it is connected.
   */
  static follow(
    panel: NotebookPanel,
    request: IRunningRequest | null | undefined,
    recorded: KernelMessage.IMessage[] = []
  ): ResumedCell | null {
    if (!request?.header?.msg_id || !request.cell_id || panel.isDisposed) {
      return null;
    }
    const cells = panel.context.model.cells;
    for (let i = 0; i < cells.length; i++) {
      const cell = cells.get(i);
      if (cell.type === 'code' && cell.id === request.cell_id) {
        const key = `${panel.id} ${cell.id}`;
        const running = ResumedCell._current.get(key);
        if (running?._request.header.msg_id === request.header.msg_id) {
          return running; // Already followed (a second restore of the same snapshot).
        }
        running?.dispose();
        const follower = new ResumedCell(
          panel,
          request,
          cell as ICodeCellModel
        );
        ResumedCell._current.set(key, follower);
        for (const msg of recorded) {
          follower._onIOPub(null, msg);
        }
        return follower;
      }
    }
    console.info(
      `kernel snapshots: the resumed cell ${request.cell_id} is not in ${panel.context.path}`
    );
    return null;
  }

  /** The message id of the request. */
  get msgId(): string {
    return this._request.header.msg_id;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /**
   * Once the notebook is connected to `kernelId`: if the kernel no longer runs the
   * request (it ended before this notebook subscribed to its messages), end it here.
   */
  async check(model: ISnapshotsModel, kernelId: string): Promise<void> {
    this._snapshots = model;
    this._kernelId = kernelId;
    const kernel = this._panel.sessionContext.session?.kernel;
    if (this._disposed || kernel?.id !== kernelId) {
      return;
    }
    if (kernel.connectionStatus !== 'connected') {
      return; // _onConnection checks again once it is.
    }
    try {
      const status = await model.fetchKernelStatus(kernelId);
      if (status.resumed_request?.header?.msg_id !== this.msgId) {
        this._finish(null);
      }
    } catch {
      this._finish(null); // The kernel is gone: nothing will end the cell but this.
    }
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    const sessionContext = this._panel.sessionContext;
    sessionContext.iopubMessage.disconnect(this._onIOPub, this);
    sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    sessionContext.connectionStatusChanged.disconnect(this._onConnection, this);
    sessionContext.statusChanged.disconnect(this._onStatus, this);
    this._panel.disposed.disconnect(this.dispose, this);
    this._watchKernel(null);
    const key = `${this._panel.id} ${this._cell.id}`;
    if (ResumedCell._current.get(key) === this) {
      ResumedCell._current.delete(key);
    }
  }

  /** Whether JupyterLab itself still handles the request (the cell's own future). */
  private _handledByLab(): boolean {
    const cell = this._panel.content.widgets.find(
      widget => widget.model === this._cell
    );
    const future = (
      cell as { outputArea?: { future?: Kernel.IFuture<any, any> } } | undefined
    )?.outputArea?.future;
    return (
      !!future && !future.isDisposed && future.msg.header.msg_id === this.msgId
    );
  }

  private _onIOPub(_: unknown, msg: KernelMessage.IMessage): void {
    if (
      this._disposed ||
      (msg.parent_header as Partial<KernelMessage.IHeader>)?.msg_id !==
        this.msgId ||
      this._handledByLab()
    ) {
      return;
    }
    // The wrapper publishes the resumed request's output again for every client that
    // subscribes later, naming the original message: each message is shown once.
    const original =
      (msg.metadata as { kernel_snapshots_replay_of?: string } | undefined)
        ?.kernel_snapshots_replay_of ?? msg.header.msg_id;
    if (this._seen.has(original)) {
      return;
    }
    this._seen.add(original);
    const content = msg.content as any;
    const outputs = this._cell.outputs;
    switch (msg.header.msg_type) {
      case 'stream':
      case 'display_data':
      case 'execute_result':
      case 'error':
        outputs.add(toOutput(msg.header.msg_type, content));
        break;
      case 'clear_output':
        outputs.clear(!!content.wait);
        break;
      case 'execute_input':
        this._request.execution_count = content.execution_count ?? null;
        break;
      case 'status':
        if (content.execution_state === 'idle') {
          this._finish(null);
        } else if (content.execution_state === 'busy') {
          this._cell.executionState = 'running';
        }
        break;
      default:
        break;
    }
  }

  /** Shell replies to the request: they reach this client only through anyMessage. */
  private _onAnyMessage(_: unknown, args: Kernel.IAnyMessageArgs): void {
    const msg = args.msg;
    if (
      args.direction === 'recv' &&
      msg.header.msg_type === 'execute_reply' &&
      (msg.parent_header as Partial<KernelMessage.IHeader>)?.msg_id ===
        this.msgId &&
      !this._handledByLab()
    ) {
      this._finish((msg.content as any).execution_count ?? null);
    }
  }

  private _onKernelChanged(): void {
    const kernel = this._panel.sessionContext.session?.kernel ?? null;
    this._watchKernel(kernel);
    if (this._kernelId && kernel && kernel.id !== this._kernelId) {
      this._abandon(); // The notebook moved on to another kernel.
    }
  }

  /** A restart or the kernel's death ends the request without a reply. */
  private _onStatus(_: unknown, status: Kernel.Status): void {
    if (['restarting', 'autorestarting', 'dead'].includes(status)) {
      this._abandon();
    }
  }

  /** Stop showing the cell as running, as JupyterLab does for its own after a restart. */
  private _abandon(): void {
    if (!this._disposed) {
      this._cell.executionState = 'idle';
      this.dispose();
    }
  }

  private _onConnection(_: unknown, status: Kernel.ConnectionStatus): void {
    if (status === 'connected' && this._snapshots && this._kernelId) {
      void this.check(this._snapshots, this._kernelId);
    }
  }

  private _watchKernel(kernel: Kernel.IKernelConnection | null): void {
    this._kernel?.anyMessage.disconnect(this._onAnyMessage, this);
    this._kernel = kernel;
    kernel?.anyMessage.connect(this._onAnyMessage, this);
  }

  /** The request ended: its execution count in the prompt, and stop following it. */
  private _finish(executionCount: number | null): void {
    if (this._disposed) {
      return;
    }
    const count = executionCount ?? this._request.execution_count;
    if (count !== null && count !== undefined) {
      this._cell.executionCount = count; // Also ends the running state.
    }
    this._cell.executionState = 'idle';
    this.dispose();
  }

  /** The follower of each cell, by notebook panel and cell id (copies share cell ids). */
  private static _current = new Map<string, ResumedCell>();
  private _disposed = false;
  private _seen = new Set<string>();
  private _kernel: Kernel.IKernelConnection | null = null;
  private _kernelId = '';
  private _snapshots: ISnapshotsModel | null = null;
}

/** An iopub output message's content as an nbformat output (as OutputArea does). */
function toOutput(type: string, content: any): nbformat.IOutput {
  const output: { [key: string]: unknown } = { ...content, output_type: type };
  delete output.transient; // display ids are the kernel connection's business
  return output as nbformat.IOutput;
}

/** Iopub messages a notebook receives while its kernel is restored in place. */
export class IOPubRecorder {
  constructor(private readonly _panel: NotebookPanel) {
    _panel.sessionContext.iopubMessage.connect(this._onIOPub, this);
  }

  /** Stop recording; the messages recorded. */
  stop(): KernelMessage.IMessage[] {
    this._panel.sessionContext.iopubMessage.disconnect(this._onIOPub, this);
    return this._messages;
  }

  private _onIOPub(_: unknown, msg: KernelMessage.IMessage): void {
    if (this._messages.length < IOPubRecorder.LIMIT) {
      this._messages.push(msg);
    }
  }

  /** At most this many messages are kept (a cell printing fast during a long restore). */
  static readonly LIMIT = 10000;
  private _messages: KernelMessage.IMessage[] = [];
}

/** Restores into a new kernel for a notebook that is not open yet, by path. */
const expected = new Map<
  string,
  { request: IRunningRequest; kernelId: string }
>();

/** A notebook about to be opened gets a kernel that goes on running `request`. */
export function expectResumed(
  path: string,
  request: IRunningRequest,
  kernelId: string
): void {
  expected.set(path, { request, kernelId });
}

/** What `expectResumed` left for the notebook at `path` (once). */
export function takeExpectedResume(
  path: string
): { request: IRunningRequest; kernelId: string } | null {
  const found = expected.get(path) ?? null;
  expected.delete(path);
  return found;
}

/**
 * The request a kernel restored by `job` goes on running: the restore's result says
 * which one was running at the snapshot, the kernel whether it still runs.
 */
export async function resumedRequest(
  model: ISnapshotsModel,
  kernelId: string,
  result: { [key: string]: any } | null | undefined
): Promise<IRunningRequest | null> {
  const recorded = (result?.running_request ?? null) as IRunningRequest | null;
  try {
    const status = await model.fetchKernelStatus(kernelId);
    return status.resumed_request ?? recorded;
  } catch {
    return recorded;
  }
}
