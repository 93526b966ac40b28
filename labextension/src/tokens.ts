/**
 * Interfaces, tokens and command ids of the Kernel Snapshots extension.
 *
 * The wire formats mirror `jupyter_ext/openapi.yaml` (REST API) and
 * `jupyter_ext/events/snapshot.yaml` (server events).
 */
import { Token } from '@lumino/coreutils';
import type { IDisposable } from '@lumino/disposable';
import type { ISignal } from '@lumino/signaling';

/** The id of this extension's plugins and of its settings. */
export const PLUGIN_ID = 'jupyter-kernel-snapshots:plugin';

/** The jupyter_events schema the server extension emits. */
export const EVENT_SCHEMA_ID =
  'https://events.jupyter.org/jupyter_kernel_snapshots/snapshot/v1';

/** The kernelspec whose kernels can be snapshotted. */
export const SNAPSHOT_KERNEL_NAME = 'python3-snapshot';

/** Its display name, as the kernel picker shows it. */
export const SNAPSHOT_KERNEL_DISPLAY_NAME = 'Python 3 (snapshots)';

/** Command ids. */
export namespace CommandIDs {
  export const snapshot = 'kernel-snapshots:snapshot';
  export const suspend = 'kernel-snapshots:suspend';
  export const resume = 'kernel-snapshots:resume';
  export const openPanel = 'kernel-snapshots:open-panel';
  export const refresh = 'kernel-snapshots:refresh';
  export const toggleShowAll = 'kernel-snapshots:toggle-show-all';
  export const useSnapshotKernel = 'kernel-snapshots:use-snapshot-kernel';
  export const undoLastCell = 'kernel-snapshots:undo-last-cell';
  export const undoBeforeCell = 'kernel-snapshots:undo-before-cell';
  export const redo = 'kernel-snapshots:redo';
}

/** What the server says went wrong: `{"message", "reason", "code", "hint", "log_excerpt"}`. */
export interface IErrorBody {
  message?: string;
  reason?: string;
  code?: string;
  hint?: string;
  log_excerpt?: string;
}

export type Trigger =
  | 'manual'
  | 'periodic'
  | 'long-cell'
  | 'idle-suspend'
  | 'cull'
  | 'admin-shutdown'
  | 'before-shutdown'
  | 'before-restore'
  | 'start'
  | 'cell'
  | 'before-undo'
  | 'before-redo';

/** One variable of a snapshot's kernel, read without running its code. */
export interface IVariable {
  name: string;
  type: string;
  size: number;
  estimated?: boolean;
  shape?: number[];
  dtype?: string;
  length?: number;
  device?: string;
  error?: string;
}

/** A cell run since the previous snapshot (the listing has its first line only). */
export interface ICellRecord {
  execution_count?: number | null;
  /** The code (full record) ... */
  code?: string;
  /** ... or its first line (listing). */
  first_line?: string;
  started?: number;
  seconds?: number | null;
  running?: boolean;
  trimmed?: boolean;
}

/** What a snapshot holds: short in a listing, full from `GET /api/snapshots/{id}`. */
export interface IContents {
  cells?: ICellRecord[];
  variables?: IVariable[];
  /** Every listed variable's name (listing only: what the search matches). */
  variable_names?: string[];
  variable_count?: number;
  variables_bytes?: number;
  partial?: boolean;
  partial_reason?: string;
  /** The kernel's language, for a kernel other than ipykernel ("R"). */
  language?: string;
  /** Why the kernel's language gives no variables (e.g. xeus-python). */
  variables_unavailable?: string;
  /** Why its variables cannot be taken back (every kernel but ipykernel, e.g. R). */
  take_unavailable?: string;
}

export type SnapshotStatus =
  'complete' | 'uploading' | 'upload-failed' | 'checkpoint';

/** `GET /api/snapshots`: the snapshots, and why the store's are missing ('' when not). */
export interface ISnapshotList {
  snapshots: ISnapshot[];
  store_error?: string;
}

/** One snapshot, as listed by `GET /api/snapshots`. */
export interface ISnapshot {
  id: string;
  lineage: string;
  sequence: number;
  created: string;
  trigger: Trigger | string;
  status: SnapshotStatus | string;
  error?: string;
  /** The notebook's path when it was taken ... */
  notebook_path?: string | null;
  /** ... and where that notebook is now (after renames and moves). */
  notebook_path_now?: string | null;
  kernel_id?: string | null;
  kernel_spec?: { name?: string; kernel_id?: string; [key: string]: unknown };
  host?: string;
  total_bytes?: number;
  stored_bytes?: number;
  new_bytes?: number;
  gpu?: {
    gpus?: { name?: string; uuid?: string; [key: string]: unknown }[];
    used_gpus?: string[];
    [key: string]: unknown;
  };
  gpu_bytes?: number;
  dump_seconds?: number;
  frozen_seconds?: number;
  pause_seconds?: number;
  criu_version?: string;
  product_version?: string;
  kernel_release?: string;
  python_version?: string;
  /** What it holds (empty for snapshots from before this was recorded). */
  contents?: IContents;
  /** How the kernel's memory was copied (docs/storage.md, "Snapshots cost what changed"). */
  memory?: IMemoryCopy;
}

/** How a snapshot copied the kernel's memory: only what changed since its parent
 * ("incremental"), or all of it ("full", with the reason). */
export interface IMemoryCopy {
  mode?: 'full' | 'incremental';
  reason?: string;
  parent?: string | null;
  frozen_bytes?: number;
  copied_bytes?: number;
  frozen_total_seconds?: number;
}

export type JobKind =
  | 'snapshot'
  | 'restore'
  | 'suspend'
  | 'resume'
  | 'variables'
  | 'check'
  | 'prune'
  | 'undo'
  | 'redo';

/**
 * Every phase a job goes through, in the order a job goes through them: a job's phase only
 * moves forward (jupyter_ext/core/protocol.py's Phase, the same list).
 */
export const PHASES = [
  'queued',
  'releasing-gpu-caches',
  'gpu-checkpoint',
  'comparing',
  'dumping',
  'hashing',
  'uploading',
  'storing',
  'committing',
  'checking-cache',
  'downloading',
  'verifying',
  'saving-kernel',
  'restoring',
  'transferring',
  'serialising',
  'loading',
  'checking',
  'reading-data',
  'pruning',
  'done'
] as const;

export type Phase = (typeof PHASES)[number];

/** A snapshot, restore, suspend or resume in progress (or done). */
export interface IJob {
  id: string;
  kind: JobKind | string;
  kernel_id: string | null;
  status: 'running' | 'done' | 'failed' | string;
  phase: Phase;
  done_bytes: number;
  total_bytes: number;
  started: number;
  finished: number | null;
  result: { [key: string]: any } | null;
  error: IErrorBody | null;
}

export type KernelState =
  | 'starting'
  | 'running'
  | 'snapshotting'
  | 'restoring'
  | 'dead'
  | 'suspended'
  | 'stopping';

/**
 * The execute_request a kernel was running when it was snapshotted (the manifest's
 * `running_request`); after a restore the cell goes on (the status's `resumed_request`).
 */
export interface IRunningRequest {
  /** The execute_request's header (msg_id, session, username, msg_type, date, version). */
  header: { msg_id: string; session?: string; [key: string]: unknown };
  /** The cell it came from, as JupyterLab sent it (metadata `cellId`). */
  cell_id: string | null;
  /** The execution count the kernel gave it (its execute_input). */
  execution_count: number | null;
}

/** `GET /api/snapshots/kernels/{id}`: the wrapper's view of a kernel. */
export interface IKernelStatus {
  kernel_id: string;
  /** Whether the kernel runs under the snapshot wrapper. */
  snapshots: boolean;
  /** Why not, when `snapshots` is false. */
  reason?: string;
  state?: KernelState | string;
  execution_state?: string;
  last_activity?: number;
  executions_since_snapshot?: number;
  periodic?: boolean;
  lineage?: string;
  sequence?: number;
  wrapper_pid?: number;
  inner_pid?: number | null;
  /** GPU use of the kernel's processes now. */
  gpu?: { processes?: number; bytes?: number; utilization?: number };
  job?: IJob | null;
  /** The request a restored kernel goes on running (null once it has ended). */
  resumed_request?: IRunningRequest | null;
  /** Connections to outside peers that the last restore gave back closed. */
  closed_on_restore?: IConnection[];
  /** /dev/shm names a live process held at the last restore (private copies). */
  private_shm?: IPrivateShm[];
  /** The snapshot the kernel's state was last saved in or restored from (null before). */
  snapshot_id?: string | null;
  /** The cells run since then (the last 50). */
  cells_since_snapshot?: ICellRun[];
  /** The kernel's last death, while the offer of its snapshot stands. */
  death?: IKernelDeath | null;
  /** Its cell checkpoints now (docs/undo.md). */
  checkpoints?: ICheckpointState;
}

/** A cell a kernel ran: its execution count and first line. */
export interface ICellRun {
  execution_count: number | null;
  first_line: string;
}

/** How a kernel died, and the snapshot offered back (openapi.yaml KernelDeath). */
export interface IKernelDeath {
  at: number;
  cause: 'oom' | 'crash' | 'signal' | 'exit' | 'unknown' | string;
  /** In words: "killed by the out-of-memory killer at 14.2 GiB". */
  reason: string;
  exit_code: number | null;
  signal: string | null;
  oom: boolean;
  memory_bytes: number | null;
  memory_limit: number | null;
  /** The wrapper died too (jupyter_client started a new kernel under the same id). */
  wrapper: boolean;
  /** The snapshot offered back (null: the kernel had none). */
  snapshot_id: string | null;
  snapshot_created: string | null;
  snapshot_trigger: string | null;
  /** The cells run since the kernel's last snapshot: a restore does not bring them back. */
  cells_since: ICellRun[];
  /** False when an older snapshot than the kernel's last is offered (more cells ran). */
  cells_since_exact: boolean;
  /** A restore the server started by itself (restore_on_death). */
  restore: { job_id: string; status: string; automatic: boolean } | null;
}

/** A cell run, as the kernel's wrapper saw its request and reply. */
export interface ICheckpointCell {
  /** The notebook cell (JupyterLab's `cellId`); null for a console or a take-back. */
  cell_id: string | null;
  execution_count: number | null;
}

/** A cell checkpoint: the kernel as it was after a cell, kept on the server's machine. */
export interface ICheckpoint {
  id: string;
  kind: 'start' | 'cell' | 'before-undo' | 'before-redo' | string;
  created: string;
  /** The checkpoint its state came from before `cells`. */
  base: string | null;
  /** Cells run since `base`, oldest first (more than one: none taken between them). */
  cells: ICheckpointCell[];
  total_bytes?: number;
  /** What it added on disk (its chain's lower levels are earlier checkpoints'). */
  own_bytes?: number;
  memory?: IMemoryCopy;
  pause_seconds?: number;
  execution_count?: number | null;
}

/** A kernel's cell checkpoints now (`IKernelStatus.checkpoints`). */
export interface ICheckpointState {
  enabled: boolean;
  /** Why not, when `enabled` is false. */
  reason?: string;
  mode?: string;
  position?: string | null;
  redo?: string | null;
  /** Cells whose effects are not in the kernel (undone; their outputs stay). */
  not_in_state?: string[];
  /** The last checkpoint skipped since the last one taken. */
  skipped?: { reason: string; at: string; cells: ICheckpointCell[] } | null;
  taking?: boolean;
  /**
   * While the pause budget (`cell_checkpoint_max_pause_share`) holds back the
   * checkpoint of cells already run: seconds until it is taken.
   */
  paced_seconds?: number | null;
}

/** `GET /api/snapshots/kernels/{id}/checkpoints`. */
export interface ICheckpointListing extends ICheckpointState {
  kernel_id: string;
  checkpoints: ICheckpoint[];
  cells_since?: ICheckpointCell[];
  outside_world?: string;
}

/** A file the kernel holds open that changed since a checkpoint. */
export interface IChangedFile {
  path: string;
  size: number | null;
  was: number | null;
  change: 'written' | 'removed' | string;
}

/** What an undo or redo does (`GET`: would do; the job's result: did). */
export interface IUndo {
  kernel_id?: string;
  target: string;
  /** Cells taken out of the kernel's state, newest first. */
  undone: ICheckpointCell[];
  not_in_state: string[];
  /** False: cells run in the same batch before the one asked for go too. */
  exact: boolean;
  save: boolean;
  checkpoint?: ICheckpoint;
  changed_files?: IChangedFile[];
  problems?: string[];
  outside_world?: string;
  execution_count?: number | null;
  redo?: string | null;
  seconds?: number;
}

/** Where an undo goes: a checkpoint, before a cell, or (neither) before the last cell. */
export interface IUndoTarget {
  to?: string;
  before_cell?: string;
}

/** A /dev/shm name of the kernel's that another live process holds here. */
export interface IPrivateShm {
  name: string;
  held_by: { pid: number; process: string }[];
}

/** A TCP connection of a kernel's process (docs/network.md). */
export interface IConnection {
  pid: number;
  process: string;
  local: string;
  remote: string;
}

/** `GET /api/snapshots/policy`: the server-side policy, read-only here. */
export interface IPolicy {
  store?: string;
  location?: string;
  periodic_interval?: number;
  keep_last?: number;
  keep_hourly_hours?: number;
  keep_daily_days?: number;
  long_cell_seconds?: number;
  long_cell_min_interval?: number;
  max_store_bytes?: number;
  snapshot_before_shutdown?: boolean;
  idle_suspend_after?: number;
  suspend_cpu_kernels?: boolean;
  cull_action?: 'suspend' | 'shutdown';
  cull_idle_timeout?: number;
  restore_on_death?: boolean;
  /**
   * Set while the store outlives this machine but its key does not (an S3 store, a key
   * file, no passphrase copy): what to do, with the command. Empty otherwise.
   */
  key_notice?: string;
  [key: string]: unknown;
}

export type SnapshotAction =
  | 'started'
  | 'progress'
  | 'created'
  | 'failed'
  | 'restored'
  | 'deleted'
  | 'suspended'
  | 'resumed'
  | 'unsaved'
  | 'died';

/** One server event of the snapshot schema (flat, as the events websocket sends it). */
export interface ISnapshotEvent {
  schema_id: string;
  action: SnapshotAction;
  kernel_id?: string | null;
  snapshot_id?: string | null;
  job_id?: string | null;
  kind?: string | null;
  trigger?: string | null;
  phase?: Phase | null;
  status?: string | null;
  done_bytes?: number | null;
  total_bytes?: number | null;
  bytes?: number | null;
  path?: string | null;
  message?: string | null;
  hint?: string | null;
  reason?: string | null;
}

/**
 * Where a restore goes: in place of a running kernel (`kernel_id`), or into a new kernel
 * attached to the notebook `path` (its session `session_id`, when it has one: the
 * notebook's own session follows the restored kernel, whatever path it had).
 */
export type IRestoreTarget =
  { kernel_id: string } | { path: string; session_id?: string };

/** The notebook the panel is about: its path and kernel. */
export interface INotebookTarget {
  path: string;
  /** The kernel of its session, if it has one. */
  kernelId: string | null;
  /** The kernelspec name of that kernel ('' when none). */
  kernelName: string;
  kernelDisplayName: string;
}

/** User settings (schema/plugin.json). */
export interface ISnapshotSettings {
  showAllByDefault: boolean;
  confirmRestore: boolean;
  confirmDelete: boolean;
  refreshInterval: number;
  offerRestoreOnOpen: boolean;
  notifyBackground: boolean;
  confirmUndo: boolean;
}

export const DEFAULT_SETTINGS: ISnapshotSettings = {
  showAllByDefault: false,
  confirmRestore: true,
  confirmDelete: true,
  refreshInterval: 10,
  offerRestoreOnOpen: true,
  notifyBackground: true,
  confirmUndo: true
};

/** A job the panel follows, with how to report it. */
export interface ITrackedJob {
  job: IJob;
  /** What it is about, e.g. the notebook's name. */
  label: string;
  /** Whether to show a notification when it ends (jobs the user started). */
  notify: boolean;
}

/** The panel's model, shared by the plugins. */
export interface ISnapshotsModel extends IDisposable {
  /** Emitted whenever anything the panel shows changes. */
  readonly changed: ISignal<ISnapshotsModel, void>;
  /** Emitted when a job starts being followed. */
  readonly jobStarted: ISignal<ISnapshotsModel, ITrackedJob>;
  /** Emitted when a followed job makes progress. */
  readonly jobChanged: ISignal<ISnapshotsModel, ITrackedJob>;
  /** Emitted once when a followed job is done or failed. */
  readonly jobFinished: ISignal<ISnapshotsModel, ITrackedJob>;
  readonly snapshots: readonly ISnapshot[];
  showAll: boolean;
  target: INotebookTarget | null;
  settings: ISnapshotSettings;
  readonly policy: IPolicy | null;
  readonly error: Error | null;
  readonly storeError: string;
  readonly loaded: boolean;
  readonly loading: boolean;
  readonly jobs: ITrackedJob[];
  kernelLabel: (kernelId: string | null) => string;
  kernelStatus(kernelId: string | null | undefined): IKernelStatus | null;
  jobsFor(kernelId: string | null | undefined): ITrackedJob[];
  refresh(): Promise<void>;
  snapshot(kernelId: string): Promise<ITrackedJob>;
  suspend(kernelId: string): Promise<ITrackedJob>;
  resume(kernelId: string): Promise<ITrackedJob>;
  restore(
    snapshotId: string,
    body: IRestoreTarget,
    label?: string
  ): Promise<ITrackedJob>;
  /** The user took note of a kernel's death (or chose its new kernel): no more offer. */
  dismissDeath(kernelId: string): Promise<void>;
  /** When the server stopped answering (null while it answers). */
  readonly unreachableSince: Date | null;
  /** Emitted when the server answers again after it could not be reached. */
  readonly reconnected: ISignal<ISnapshotsModel, void>;
  /** JupyterLab could not reach the server: say so, and try again often. */
  connectionLost(): void;
  delete(snapshotId: string): Promise<void>;
  /** One snapshot with the full record of what it holds. */
  details(snapshotId: string): Promise<ISnapshot>;
  /** Copy variables from a snapshot into a running kernel (a job of kind "variables"). */
  takeVariables(
    snapshotId: string,
    kernelId: string,
    names: string[],
    rename?: { [name: string]: string },
    label?: string,
    overwrite?: boolean
  ): Promise<ITrackedJob>;
  snapshotsOf(path: string, lineage?: string | null): Promise<ISnapshot[]>;
  /** A kernel's cell checkpoints (kept fresh for the notebook the panel is about). */
  checkpointsOf(kernelId: string | null | undefined): ICheckpointListing | null;
  fetchCheckpoints(kernelId: string): Promise<ICheckpointListing>;
  /** One cell checkpoint with the full record of what it holds. */
  checkpointDetails(kernelId: string, checkpointId: string): Promise<ISnapshot>;
  /** What an undo (redo) would do: the cells it undoes, files changed since. */
  previewUndo(
    kernelId: string,
    target: IUndoTarget,
    redo?: boolean
  ): Promise<IUndo>;
  /** Undo (a job of kind "undo"), or redo (kind "redo"). */
  undo(
    kernelId: string,
    target: IUndoTarget,
    redo?: boolean,
    label?: string
  ): Promise<ITrackedJob>;
  fetchKernelStatus(kernelId: string): Promise<IKernelStatus>;
  track(job: IJob, options?: { notify?: boolean; label?: string }): ITrackedJob;
  waitFor(jobId: string): Promise<IJob>;
}

export const ISnapshotsModel = new Token<ISnapshotsModel>(
  'jupyter-kernel-snapshots:ISnapshotsModel',
  'The snapshots of kernels on this server, their jobs and the server policy.'
);
