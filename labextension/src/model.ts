/**
 * The state behind the panel: snapshots of the current notebook (or all), the snapshot
 * status of every kernel, the jobs in progress and the server policy.
 *
 * It polls the REST API (with backoff when the server fails) and listens to the server's
 * snapshot events, so that work started elsewhere (periodic snapshots, idle suspend,
 * another browser tab) shows up at once.
 */
import type { Event } from '@jupyterlab/services';
import { ServerConnection } from '@jupyterlab/services';
import { PromiseDelegate } from '@lumino/coreutils';
import { Debouncer, IPoll, Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  describeError,
  jsonBody,
  requestAPI,
  SnapshotAPIError
} from './request';
import {
  DEFAULT_SETTINGS,
  EVENT_SCHEMA_ID,
  ICheckpointListing,
  IJob,
  IKernelStatus,
  INotebookTarget,
  IPolicy,
  IRestoreTarget,
  PHASES,
  ISnapshot,
  ISnapshotEvent,
  ISnapshotList,
  ISnapshotSettings,
  ISnapshotsModel,
  ITrackedJob,
  IUndo,
  IUndoTarget
} from './tokens';

/** Kernel states that change by themselves soon: refresh quickly while one lasts. */
const TRANSIENT_STATES = new Set([
  'starting',
  'snapshotting',
  'restoring',
  'stopping'
]);

/** The longest wait between two refreshes when the server keeps failing (ms). */
const MAX_BACKOFF_MS = 5 * 60 * 1000;

/** How often the server is tried while it cannot be reached at all (ms). */
const RECONNECT_MS = 2000;

/** How often a job in progress is looked at (ms). */
const JOB_POLL_MS = 500;

/** How often the list is refreshed while something is in progress (ms). */
const FAST_REFRESH_MS = 1000;

export class SnapshotsModel implements ISnapshotsModel {
  constructor(options: SnapshotsModel.IOptions = {}) {
    this._serverSettings =
      options.serverSettings ?? ServerConnection.makeSettings();
    this._settings = { ...DEFAULT_SETTINGS, ...options.settings };
    this._showAll = this._settings.showAllByDefault;
    this._events = options.events ?? null;
    this._events?.stream.connect(this._onEvent, this);
    this._refreshSoon = new Debouncer(() => this._requestRefresh(), 250);
    this._refreshFast = new Debouncer(
      () => this._requestRefresh(),
      FAST_REFRESH_MS
    );
    this._poll = new Poll({
      auto: options.auto ?? true,
      factory: () => this._tick(),
      frequency: this._frequency(),
      name: 'jupyter-kernel-snapshots:model',
      standby: options.standby ?? 'when-hidden'
    });
  }

  /** Emitted whenever anything the panel shows changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted when a job starts being followed. */
  get jobStarted(): ISignal<this, ITrackedJob> {
    return this._jobStarted;
  }

  /** Emitted when a followed job makes progress (phase, bytes). */
  get jobChanged(): ISignal<this, ITrackedJob> {
    return this._jobChanged;
  }

  /** Emitted once when a followed job is done or failed. */
  get jobFinished(): ISignal<this, ITrackedJob> {
    return this._jobFinished;
  }

  /** Emitted when the server answers again after it could not be reached. */
  get reconnected(): ISignal<this, void> {
    return this._reconnected;
  }

  get serverSettings(): ServerConnection.ISettings {
    return this._serverSettings;
  }

  /**
   * When the server stopped answering (null while it answers): what the panel shows
   * of kernels is then what they were, not what they are.
   */
  get unreachableSince(): Date | null {
    return this._unreachableSince;
  }

  /**
   * JupyterLab could not reach the server (its ServiceManager's connectionFailure): say
   * so at once, and try again often until it answers.
   */
  connectionLost(): void {
    if (this._unreachable()) {
      void this._refreshSoon.invoke();
    }
  }

  get snapshots(): readonly ISnapshot[] {
    return this._snapshots;
  }

  /** Whether the list shows every snapshot in the store, not only the notebook's. */
  get showAll(): boolean {
    return this._showAll;
  }
  set showAll(value: boolean) {
    if (value === this._showAll) {
      return;
    }
    this._showAll = value;
    this._snapshots = [];
    this._loaded = false;
    this._changed.emit();
    void this._refreshSoon.invoke();
  }

  /** The notebook the panel is about (null when no notebook is current). */
  get target(): INotebookTarget | null {
    return this._target;
  }
  set target(value: INotebookTarget | null) {
    const old = this._target;
    if (
      old === value ||
      (old &&
        value &&
        old.path === value.path &&
        old.kernelId === value.kernelId &&
        old.kernelName === value.kernelName &&
        old.kernelDisplayName === value.kernelDisplayName)
    ) {
      return;
    }
    this._target = value;
    if (old?.path !== value?.path && !this._showAll) {
      this._snapshots = [];
      this._loaded = false;
    }
    this._changed.emit();
    void this._refreshSoon.invoke();
  }

  get policy(): IPolicy | null {
    return this._policy;
  }

  /** The last error of a refresh (null once a refresh succeeds). */
  get error(): Error | null {
    return this._error;
  }

  /**
   * Why the store cannot be reached ('' if it can): the list then only holds the
   * snapshots waiting on this server for their upload.
   */
  get storeError(): string {
    return this._storeError;
  }

  /** Whether the current list has been loaded at least once. */
  get loaded(): boolean {
    return this._loaded;
  }

  get loading(): boolean {
    return this._loading;
  }

  get settings(): ISnapshotSettings {
    return this._settings;
  }
  set settings(value: ISnapshotSettings) {
    this._settings = { ...value };
    const frequency = this._frequency();
    if (this._poll.frequency.interval !== frequency.interval) {
      this._poll.frequency = frequency;
      // The tick already scheduled used the old interval.
      void this._poll.refresh();
    }
    this._changed.emit();
  }

  /** The poll's pace: the settings' interval with backoff, or fast while unreachable. */
  private _frequency(): IPoll.Frequency {
    if (this._unreachableSince !== null) {
      return { interval: RECONNECT_MS, backoff: false, max: RECONNECT_MS };
    }
    const interval = Math.max(1, this._settings.refreshInterval) * 1000;
    return { interval, backoff: true, max: Math.max(MAX_BACKOFF_MS, interval) };
  }

  /** A label for a kernel in notifications (e.g. its notebook's name). */
  kernelLabel: (kernelId: string | null) => string = kernelId =>
    kernelId ? `kernel ${kernelId.slice(0, 8)}` : 'a kernel';

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._events?.stream.disconnect(this._onEvent, this);
    this._poll.dispose();
    this._refreshSoon.dispose();
    this._refreshFast.dispose();
    for (const tracked of this._jobs.values()) {
      this._waiters.get(tracked.job.id)?.resolve(tracked.job);
    }
    this._jobs.clear();
    this._waiters.clear();
    Signal.clearData(this);
  }

  /** The snapshot status of a kernel, as last polled (null if unknown). */
  kernelStatus(kernelId: string | null | undefined): IKernelStatus | null {
    if (!kernelId) {
      return null;
    }
    return this._kernels.get(kernelId) ?? null;
  }

  /** The jobs in progress on a kernel (or, for null, on no kernel). */
  jobsFor(kernelId: string | null | undefined): ITrackedJob[] {
    return [...this._jobs.values()].filter(
      tracked => (tracked.job.kernel_id ?? null) === (kernelId ?? null)
    );
  }

  /** Every job being followed. */
  get jobs(): ITrackedJob[] {
    return [...this._jobs.values()];
  }

  /** Refresh now; resolves once the refresh is done. */
  async refresh(): Promise<void> {
    this._policyStale = true;
    await this._poll.refresh();
    await this._poll.tick;
  }

  /** Snapshot a kernel (202 with a job that is followed until it ends). */
  async snapshot(kernelId: string): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      '',
      jsonBody('POST', { kernel_id: kernelId }),
      this._serverSettings
    );
    return this.track(job, { notify: true });
  }

  /** Snapshot a kernel and end its process; the next cell resumes it. */
  async suspend(kernelId: string): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      `kernels/${kernelId}/suspend`,
      { method: 'POST' },
      this._serverSettings
    );
    return this.track(job, { notify: true });
  }

  /** Bring a suspended kernel back now. */
  async resume(kernelId: string): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      `kernels/${kernelId}/resume`,
      { method: 'POST' },
      this._serverSettings
    );
    return this.track(job, { notify: true });
  }

  /**
   * Restore a snapshot in place of the kernel `kernel_id`, or into a new kernel attached
   * to the notebook `path`. An incompatible snapshot is refused at once (422); the job
   * downloads it and checks every hash before the restore starts.
   */
  async restore(
    snapshotId: string,
    body: IRestoreTarget,
    label?: string
  ): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      `${snapshotId}/restore`,
      jsonBody('POST', body),
      this._serverSettings
    );
    return this.track(job, { notify: true, label });
  }

  /** Delete a snapshot (chunks shared with other snapshots stay in the store). */
  async delete(snapshotId: string): Promise<void> {
    await requestAPI<void>(
      snapshotId,
      { method: 'DELETE' },
      this._serverSettings
    );
    this._snapshots = this._snapshots.filter(s => s.id !== snapshotId);
    this._changed.emit();
    void this._refreshSoon.invoke();
  }

  /** One snapshot with the full record of what it holds. */
  async details(snapshotId: string): Promise<ISnapshot> {
    return requestAPI<ISnapshot>(snapshotId, {}, this._serverSettings);
  }

  /**
   * Copy variables from a snapshot into the running kernel `kernelId` (restored as a side
   * kernel on the server, pickled there, loaded all-or-none into the kernel). Variables
   * the kernel has are replaced only with `overwrite` (else 409 variables-exist).
   */
  async takeVariables(
    snapshotId: string,
    kernelId: string,
    names: string[],
    rename: { [name: string]: string } = {},
    label?: string,
    overwrite = false
  ): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      `${snapshotId}/variables`,
      jsonBody('POST', { kernel_id: kernelId, names, rename, overwrite }),
      this._serverSettings
    );
    return this.track(job, { notify: true, label });
  }

  /**
   * The newest snapshots of a notebook (and of a kernel lineage, the kernel it lost),
   * without changing what the panel shows.
   */
  async snapshotsOf(
    path: string,
    lineage: string | null = null
  ): Promise<ISnapshot[]> {
    const { snapshots } = await this._merged([
      `?path=${encodeURIComponent(path)}`,
      ...(lineage ? [`?lineage=${encodeURIComponent(lineage)}`] : [])
    ]);
    return snapshots;
  }

  /** The user took note of a kernel's death (or chose its new kernel): no more offer. */
  async dismissDeath(kernelId: string): Promise<void> {
    const status = await requestAPI<IKernelStatus>(
      `kernels/${kernelId}`,
      jsonBody('PATCH', { dismiss_death: true }),
      this._serverSettings
    );
    this._kernels.set(kernelId, status);
    this._changed.emit();
  }

  /** A kernel's cell checkpoints as last fetched (the panel's kernel's, each refresh). */
  checkpointsOf(
    kernelId: string | null | undefined
  ): ICheckpointListing | null {
    return kernelId ? (this._checkpoints.get(kernelId) ?? null) : null;
  }

  /** A kernel's cell checkpoints, asked now. */
  async fetchCheckpoints(kernelId: string): Promise<ICheckpointListing> {
    const listing = await requestAPI<ICheckpointListing>(
      `kernels/${kernelId}/checkpoints`,
      {},
      this._serverSettings
    );
    this._checkpoints.set(kernelId, listing);
    this._changed.emit();
    return listing;
  }

  /** One cell checkpoint with the full record of what it holds. */
  async checkpointDetails(
    kernelId: string,
    checkpointId: string
  ): Promise<ISnapshot> {
    return requestAPI<ISnapshot>(
      `kernels/${kernelId}/checkpoints/${checkpointId}`,
      {},
      this._serverSettings
    );
  }

  /** What an undo (redo) would do: the checkpoint, the cells, the files changed since. */
  async previewUndo(
    kernelId: string,
    target: IUndoTarget,
    redo = false
  ): Promise<IUndo> {
    const query = new URLSearchParams(
      Object.entries(target).filter(([, v]) => !!v) as [string, string][]
    ).toString();
    return requestAPI<IUndo>(
      `kernels/${kernelId}/${redo ? 'redo' : 'undo'}${query ? `?${query}` : ''}`,
      {},
      this._serverSettings
    );
  }

  /** Undo (or redo): the kernel restored in place from a cell checkpoint, as a job. */
  async undo(
    kernelId: string,
    target: IUndoTarget,
    redo = false,
    label?: string
  ): Promise<ITrackedJob> {
    const { job } = await requestAPI<{ job: IJob }>(
      `kernels/${kernelId}/${redo ? 'redo' : 'undo'}`,
      jsonBody('POST', target),
      this._serverSettings
    );
    return this.track(job, { notify: true, label });
  }

  /** The snapshot status of one kernel, asked now. */
  async fetchKernelStatus(kernelId: string): Promise<IKernelStatus> {
    const status = await requestAPI<IKernelStatus>(
      `kernels/${kernelId}`,
      {},
      this._serverSettings
    );
    this._kernels.set(kernelId, status);
    this._changed.emit();
    return status;
  }

  /**
   * Follow a job until it ends (polling `GET /api/snapshots/jobs/{id}`; events speed it up).
   * Following the same job twice merges the options.
   */
  track(job: IJob, options: { notify?: boolean; label?: string } = {}) {
    let tracked = this._jobs.get(job.id);
    const ended = this._ended.get(job.id);
    if (!tracked && ended) {
      // Already ended here: a listing or an event from before its end says nothing new.
      return ended;
    }
    if (tracked) {
      tracked.notify = tracked.notify || !!options.notify;
      tracked.label = options.label ?? tracked.label;
      this._merge(tracked, job);
      return tracked;
    }
    tracked = {
      job,
      notify: !!options.notify,
      label: options.label ?? this.kernelLabel(job.kernel_id)
    };
    this._jobs.set(job.id, tracked);
    this._jobStarted.emit(tracked);
    this._changed.emit();
    if (job.status !== 'running') {
      this._finish(tracked);
    } else {
      void this._follow(tracked);
    }
    return tracked;
  }

  /** Resolves with the job once it is done or failed. */
  waitFor(jobId: string): Promise<IJob> {
    const tracked = this._jobs.get(jobId);
    if (!tracked) {
      return Promise.reject(new Error(`Job ${jobId} is not followed.`));
    }
    let waiter = this._waiters.get(jobId);
    if (!waiter) {
      waiter = new PromiseDelegate<IJob>();
      this._waiters.set(jobId, waiter);
    }
    return waiter.promise;
  }

  private async _tick(): Promise<void> {
    const target = this._target;
    const showAll = this._showAll;
    const settings = this._serverSettings;
    this._loading = true;
    this._changed.emit();
    try {
      const [kernels, policy] = await Promise.all([
        requestAPI<{ kernels: IKernelStatus[] }>('kernels', {}, settings),
        this._policy && !this._policyStale
          ? Promise.resolve(this._policy)
          : requestAPI<IPolicy>('policy', {}, settings)
      ]);
      const statuses = new Map(
        (kernels.kernels ?? []).map(status => [status.kernel_id, status])
      );
      const list = showAll
        ? await requestAPI<ISnapshotList>('', {}, settings)
        : target
          ? await this._listOf(target, statuses.get(target.kernelId ?? ''))
          : { snapshots: [] };
      if (this._isDisposed) {
        return;
      }
      this._kernels = statuses;
      this._policy = policy;
      this._policyStale = false;
      this._error = null;
      this._reachable();
      // A newer target or switch won: its own refresh is on the way.
      if (target === this._target && showAll === this._showAll) {
        this._snapshots = list.snapshots ?? [];
        this._storeError = list.store_error ?? '';
        this._loaded = true;
      }
      for (const status of this._kernels.values()) {
        if (status.job && status.job.status === 'running') {
          this.track(status.job);
        }
      }
      await this._refreshCheckpoints(target);
    } catch (error) {
      this._error =
        error instanceof Error
          ? error
          : new Error(describeError(error).message);
      if (error instanceof SnapshotAPIError && error.status === 0) {
        this._unreachable(); // the poll tries again soon by itself
      }
      throw error;
    } finally {
      this._loading = false;
      if (!this._isDisposed) {
        this._changed.emit();
        if (this._refreshAgain) {
          this._refreshAgain = false;
          void this._refreshSoon.invoke();
        } else if (this._busy()) {
          void this._refreshFast.invoke();
        }
      }
    }
  }

  /**
   * The cell checkpoints of the panel's kernel (a snapshot kernel with them on): its
   * timeline. Those of other kernels are dropped; a failure keeps the last listing.
   */
  private async _refreshCheckpoints(
    target: INotebookTarget | null
  ): Promise<void> {
    const kernelId = target?.kernelId;
    const status = this.kernelStatus(kernelId);
    for (const other of [...this._checkpoints.keys()]) {
      if (other !== kernelId) {
        this._checkpoints.delete(other);
      }
    }
    if (!kernelId || !status?.snapshots || !status.checkpoints) {
      return;
    }
    try {
      this._checkpoints.set(
        kernelId,
        await requestAPI<ICheckpointListing>(
          `kernels/${kernelId}/checkpoints`,
          {},
          this._serverSettings
        )
      );
    } catch {
      // The kernel went away meanwhile: the next refresh says so.
    }
  }

  /**
   * The snapshots of a notebook: those taken while it was at its path, those of its
   * kernel, and those of its kernel's lineage (the snapshots it was restored from, under
   * whatever path their notebook had then). The server knows a kernel's notebook from
   * its session, which can keep an older path (JupyterLab renaming a notebook as its
   * session starts sends the old one), so a snapshot of this very kernel may carry
   * another path.
   */
  private _listOf(
    target: INotebookTarget,
    status: IKernelStatus | undefined
  ): Promise<ISnapshotList> {
    const queries = [`?path=${encodeURIComponent(target.path)}`];
    if (target.kernelId) {
      queries.push(`?kernel_id=${encodeURIComponent(target.kernelId)}`);
    }
    if (status?.snapshots && status.lineage) {
      queries.push(`?lineage=${encodeURIComponent(status.lineage)}`);
    }
    return this._merged(queries);
  }

  /** The snapshots of several listings, each once, newest first. */
  private async _merged(queries: string[]): Promise<ISnapshotList> {
    const lists = await Promise.all(
      queries.map(query =>
        requestAPI<ISnapshotList>(query, {}, this._serverSettings)
      )
    );
    const byId = new Map<string, ISnapshot>();
    for (const list of lists) {
      for (const snapshot of list.snapshots ?? []) {
        byId.set(snapshot.id, snapshot);
      }
    }
    return {
      snapshots: [...byId.values()].sort(
        (a, b) => b.created.localeCompare(a.created) || b.sequence - a.sequence
      ),
      store_error: lists.map(list => list.store_error).find(Boolean) ?? ''
    };
  }

  /** The server cannot be reached (from now, if it could): true if that is news. */
  private _unreachable(): boolean {
    if (this._unreachableSince !== null) {
      return false;
    }
    this._unreachableSince = new Date();
    this._poll.frequency = this._frequency();
    this._changed.emit();
    return true;
  }

  /** The server answered: after it could not be reached, say it is back. */
  private _reachable(): void {
    if (this._unreachableSince !== null) {
      this._unreachableSince = null;
      this._poll.frequency = this._frequency();
      this._reconnected.emit();
    }
  }

  /**
   * Refresh as soon as possible. A refresh asked for while one is in flight would be
   * dropped by the poll (its phase is "refreshed" until the answer comes) although that
   * answer may predate what changed (a job that just ended, another notebook): it is
   * asked for again once the answer is in.
   */
  private _requestRefresh(): Promise<void> {
    if (this._loading) {
      this._refreshAgain = true;
      return Promise.resolve();
    }
    return this._poll.refresh();
  }

  /** Whether something is in progress that the panel should follow closely. */
  private _busy(): boolean {
    if (this._jobs.size > 0) {
      return true;
    }
    for (const status of this._kernels.values()) {
      if (status.state && TRANSIENT_STATES.has(status.state)) {
        return true;
      }
      if (status.checkpoints?.taking) {
        return true; // the timeline gets its new checkpoint in a moment
      }
    }
    return this._snapshots.some(s => s.status === 'uploading');
  }

  private async _follow(tracked: ITrackedJob): Promise<void> {
    let failures = 0;
    while (!this._isDisposed && this._jobs.get(tracked.job.id) === tracked) {
      await new Promise(resolve => setTimeout(resolve, JOB_POLL_MS));
      if (this._isDisposed || tracked.job.status !== 'running') {
        break;
      }
      let job: IJob;
      try {
        job = await requestAPI<IJob>(
          `jobs/${tracked.job.id}`,
          {},
          this._serverSettings
        );
      } catch (error) {
        failures += 1;
        if (
          (error instanceof SnapshotAPIError && error.status === 404) ||
          failures > 60
        ) {
          const { message, hint } = describeError(error);
          this._merge(tracked, {
            ...tracked.job,
            status: 'failed',
            error: {
              message: `Lost track of the ${tracked.job.kind}: ${message}`,
              hint: hint || 'Refresh the panel to see whether it finished.'
            }
          });
          break;
        }
        continue;
      }
      failures = 0;
      this._merge(tracked, job);
      if (job.status !== 'running') {
        break; // ended: reported now, not a poll interval later
      }
    }
    if (!this._isDisposed && this._jobs.get(tracked.job.id) === tracked) {
      this._finish(tracked);
    }
  }

  /**
   * One story per job: an answer from before the last one heard (a poll that crossed an
   * event) never moves it back, and "done" is its end, not a phase while it runs.
   */
  private _merge(tracked: ITrackedJob, job: IJob): void {
    const current = tracked.job;
    if (
      job.status === 'running' &&
      (job.phase === 'done' ||
        PHASES.indexOf(job.phase) < PHASES.indexOf(current.phase))
    ) {
      return;
    }
    tracked.job = { ...current, ...job };
    this._jobChanged.emit(tracked);
    this._changed.emit();
  }

  private _finish(tracked: ITrackedJob): void {
    this._ended.set(tracked.job.id, tracked);
    if (this._ended.size > 200) {
      this._ended.delete(this._ended.keys().next().value as string);
    }
    this._jobs.delete(tracked.job.id);
    this._jobFinished.emit(tracked);
    this._waiters.get(tracked.job.id)?.resolve(tracked.job);
    this._waiters.delete(tracked.job.id);
    this._changed.emit();
    void this._refreshSoon.invoke();
  }

  private _onEvent(_: unknown, emission: Event.Emission): void {
    if (emission.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const event = emission as unknown as ISnapshotEvent;
    const jobId = event.job_id ?? null;
    if (jobId && !this._ended.has(jobId)) {
      const tracked = this._jobs.get(jobId);
      if (tracked) {
        if (event.action === 'progress' && event.phase) {
          // Progress events carry the bytes too: no need to wait for the next poll.
          this._merge(tracked, {
            ...tracked.job,
            phase: event.phase,
            done_bytes: event.done_bytes ?? tracked.job.done_bytes,
            total_bytes: event.total_bytes ?? tracked.job.total_bytes
          });
        }
      } else if (['started', 'progress', 'failed'].includes(event.action)) {
        // Work started elsewhere (periodic, idle suspend, another tab): follow it too.
        const job: IJob = {
          id: jobId,
          kind: event.kind ?? 'snapshot',
          kernel_id: event.kernel_id ?? null,
          status: 'running',
          phase: event.phase ?? 'queued',
          done_bytes: event.done_bytes ?? 0,
          total_bytes: event.total_bytes ?? 0,
          started: Date.now() / 1000,
          finished: null,
          result: null,
          error: null
        };
        this.track(job, { notify: false });
      }
    }
    void this._refreshSoon.invoke();
  }

  private _changed = new Signal<this, void>(this);
  private _reconnected = new Signal<this, void>(this);
  private _unreachableSince: Date | null = null;
  private _jobStarted = new Signal<this, ITrackedJob>(this);
  private _jobChanged = new Signal<this, ITrackedJob>(this);
  private _jobFinished = new Signal<this, ITrackedJob>(this);
  private _serverSettings: ServerConnection.ISettings;
  private _settings: ISnapshotSettings;
  private _events: Event.IManager | null;
  private _poll: Poll;
  private _refreshSoon: Debouncer;
  private _refreshFast: Debouncer;
  private _refreshAgain = false;
  private _snapshots: ISnapshot[] = [];
  private _kernels = new Map<string, IKernelStatus>();
  private _checkpoints = new Map<string, ICheckpointListing>();
  private _jobs = new Map<string, ITrackedJob>();
  /** Jobs that ended here (the latest 200): what comes after about them is old news. */
  private _ended = new Map<string, ITrackedJob>();
  private _waiters = new Map<string, PromiseDelegate<IJob>>();
  private _policy: IPolicy | null = null;
  private _policyStale = false;
  private _target: INotebookTarget | null = null;
  private _showAll = false;
  private _error: Error | null = null;
  private _storeError = '';
  private _loaded = false;
  private _loading = false;
  private _isDisposed = false;
}

export namespace SnapshotsModel {
  export interface IOptions {
    /** The server to talk to (default: the page's). */
    serverSettings?: ServerConnection.ISettings;
    /** The server's event stream (`app.serviceManager.events`). */
    events?: Event.IManager | null;
    /** The user's settings (defaults: DEFAULT_SETTINGS). */
    settings?: Partial<ISnapshotSettings>;
    /** Whether to start polling at once (default: true). */
    auto?: boolean;
    /** When to stop polling (default: when the page is hidden). */
    standby?: Poll.Standby | (() => boolean | Poll.Standby);
  }
}
