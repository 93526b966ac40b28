/**
 * Unit tests of the snapshots model against a stubbed server connection: its state,
 * signals, refresh and job following, and how it calls the REST API. The REST API itself
 * is tested by the Python tests and the Playwright tests.
 *
 * Time is jest's fake clock in every test: the model's polls, debounced refreshes and job
 * polls run when a test advances the clock (`advance`), never by waiting on the wall
 * clock, and a test waits for the model's own signals (`Refreshes`, `signalled`) rather
 * than for some time to pass.
 */
import type { Event } from '@jupyterlab/services';
import { PromiseDelegate } from '@lumino/coreutils';
import { ISignal, Signal } from '@lumino/signaling';

import { SnapshotsModel } from '../model';
import { IAnswer, StubServer } from './stubServer';
import { requestAPI, SnapshotAPIError } from '../request';
import {
  EVENT_SCHEMA_ID,
  IJob,
  IKernelStatus,
  ISnapshot,
  ITrackedJob
} from '../tokens';

function snapshot(id: string, extra: Partial<ISnapshot> = {}): ISnapshot {
  return {
    id,
    lineage: 'lin',
    sequence: 1,
    created: '2026-12-01T10:00:00Z',
    trigger: 'manual',
    status: 'stored',
    notebook_path: 'a.ipynb',
    ...extra
  };
}

function job(id: string, extra: Partial<IJob> = {}): IJob {
  return {
    id,
    kind: 'snapshot',
    kernel_id: 'k1',
    status: 'running',
    phase: 'queued',
    done_bytes: 0,
    total_bytes: 0,
    started: 0,
    finished: null,
    result: null,
    error: null,
    ...extra
  };
}

const KERNEL: IKernelStatus = {
  kernel_id: 'k1',
  snapshots: true,
  state: 'running'
};

const TARGET = {
  path: 'a.ipynb',
  kernelId: 'k1',
  kernelName: 'python3-snapshots',
  kernelDisplayName: 'Python 3 (snapshots)'
};

/** A server with one notebook a.ipynb, its kernel k1 and two snapshots. */
function standardServer(): StubServer {
  const server = new StubServer();
  server.on('GET', 'kernels', { body: { kernels: [KERNEL] } });
  server.on('GET', 'policy', { body: { store: 'local', keep_last: 5 } });
  server.on('GET', '', {
    body: {
      snapshots: [snapshot('s1'), snapshot('s9', { notebook_path: 'b' })]
    }
  });
  server.on('GET', '?path=a.ipynb', {
    body: {
      snapshots: [snapshot('s2', { created: '2026-12-01T12:00:00Z' })]
    }
  });
  server.on('GET', '?kernel_id=k1', {
    body: {
      snapshots: [
        snapshot('s2', { created: '2026-12-01T12:00:00Z' }),
        snapshot('s3', { created: '2026-12-01T13:00:00Z', notebook_path: 'x' })
      ]
    }
  });
  return server;
}

/** How often the model polls a job in progress (model.ts JOB_POLL_MS). */
const JOB_POLL_MS = 500;

/**
 * Let `ms` of fake time pass: every timer due in it runs, and the promises it starts get
 * their turn between timers (the stub server answers with promises only).
 */
const advance = (ms: number): Promise<void> =>
  jest.advanceTimersByTimeAsync(ms);

/** Resolves with the next emission of a signal. */
function signalled<T, U>(signal: ISignal<T, U>): Promise<U> {
  return new Promise<U>(resolve => {
    const once = (_: T, args: U) => {
      signal.disconnect(once);
      resolve(args);
    };
    signal.connect(once);
  });
}

/**
 * The model's refreshes as its `changed` signal tells them: `started` counts those that
 * began (a refresh sets `loading` at once, when its timer runs), `settled()` waits until
 * every one that began has ended.
 */
class Refreshes {
  started = 0;
  ended = 0;

  constructor(private _model: SnapshotsModel) {
    _model.changed.connect(this._onChanged, this);
  }

  settled(): Promise<void> {
    return new Promise<void>(resolve => {
      if (this.ended === this.started) {
        resolve();
      } else {
        this._waiters.push(resolve);
      }
    });
  }

  private _onChanged(): void {
    const loading = this._model.loading;
    if (loading && !this._loading) {
      this.started += 1;
    } else if (!loading && this._loading) {
      this.ended += 1;
      if (this.ended === this.started) {
        this._waiters.splice(0).forEach(resolve => resolve());
      }
    }
    this._loading = loading;
  }

  private _loading = false;
  private _waiters: (() => void)[] = [];
}

describe('SnapshotsModel', () => {
  let server: StubServer;
  let model: SnapshotsModel;
  let events: { stream: Signal<any, Event.Emission> };
  let refreshes: Refreshes;

  const create = (options: Partial<SnapshotsModel.IOptions> = {}) => {
    events = { stream: new Signal<any, Event.Emission>({}) };
    model = new SnapshotsModel({
      serverSettings: server.settings,
      events: events as unknown as Event.IManager,
      auto: false,
      standby: 'never',
      ...options
    });
    refreshes = new Refreshes(model);
    return model;
  };

  /** `model.refresh()`: its timer (due at once) is run; resolves when the refresh is done. */
  const refresh = async (): Promise<void> => {
    const done = model.refresh();
    await advance(0);
    await done;
  };

  /**
   * Advance the clock `step` ms at a time, at most `steps` times, until one more refresh
   * started; resolves when it is done (fails if none started).
   */
  const nextRefresh = async (step: number, steps: number): Promise<void> => {
    const before = refreshes.started;
    for (let i = 0; i < steps && refreshes.started === before; i++) {
      await advance(step);
    }
    expect(refreshes.started).toBe(before + 1);
    await refreshes.settled();
  };

  /** The GET requests made so far for `path`. */
  const gets = (path: string) => server.paths().filter(p => p === path).length;

  const emit = (event: Record<string, unknown>) =>
    events.stream.emit({
      schema_id: EVENT_SCHEMA_ID,
      ...event
    } as unknown as Event.Emission);

  beforeEach(() => {
    // Timers only: promises, and the ticks between them, stay real.
    jest.useFakeTimers({
      doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate']
    });
    server = standardServer();
  });

  afterEach(() => {
    model?.dispose();
    jest.useRealTimers();
  });

  describe('state', () => {
    it('starts empty, not loaded, with the default settings', () => {
      create();
      expect(model.snapshots).toEqual([]);
      expect(model.loaded).toBe(false);
      expect(model.loading).toBe(false);
      expect(model.target).toBeNull();
      expect(model.policy).toBeNull();
      expect(model.error).toBeNull();
      expect(model.showAll).toBe(false);
      expect(model.settings.refreshInterval).toBeGreaterThan(0);
      expect(model.kernelStatus('k1')).toBeNull();
      expect(model.jobs).toEqual([]);
    });

    it('shows all snapshots by default when the settings say so', () => {
      create({ settings: { showAllByDefault: true } });
      expect(model.showAll).toBe(true);
    });

    it('lists nothing without a notebook, but loads kernels and policy', async () => {
      create();
      await refresh();
      expect(model.loaded).toBe(true);
      expect(model.snapshots).toEqual([]);
      expect(model.kernelStatus('k1')).toEqual(KERNEL);
      expect(model.kernelStatus('other')).toBeNull();
      expect(model.kernelStatus(null)).toBeNull();
      expect(model.policy).toEqual({ store: 'local', keep_last: 5 });
      expect(server.paths().sort()).toEqual(['kernels', 'policy']);
    });

    it("lists a notebook's snapshots by path and by kernel, newest first", async () => {
      create();
      model.target = TARGET;
      await refresh();
      expect(model.snapshots.map(s => s.id)).toEqual(['s3', 's2']);
      expect(server.paths()).toEqual(
        expect.arrayContaining(['?path=a.ipynb', '?kernel_id=k1'])
      );
      expect(server.paths()).not.toContain('');
    });

    it('encodes the path of the notebook in the query', async () => {
      create();
      server.on('GET', '?path=dir%2Fa%20b.ipynb', { body: { snapshots: [] } });
      model.target = { ...TARGET, path: 'dir/a b.ipynb', kernelId: null };
      await refresh();
      expect(server.paths()).toContain('?path=dir%2Fa%20b.ipynb');
      expect(server.paths()).not.toContain('?kernel_id=k1');
    });

    it('lists the whole store when showing all', async () => {
      create();
      model.showAll = true;
      await refresh();
      expect(model.snapshots.map(s => s.id)).toEqual(['s1', 's9']);
      expect(server.paths()).toContain('');
    });

    it('reports why the store cannot be reached', async () => {
      server.on('GET', '?path=a.ipynb', {
        body: { snapshots: [], store_error: 'bucket gone' }
      });
      create();
      model.target = { ...TARGET, kernelId: null };
      await refresh();
      expect(model.storeError).toBe('bucket gone');
    });
  });

  describe('signals', () => {
    it('emits changed when loading starts and ends', async () => {
      create();
      const loading: boolean[] = [];
      model.changed.connect(() => loading.push(model.loading));
      await refresh();
      expect(loading[0]).toBe(true);
      expect(loading[loading.length - 1]).toBe(false);
    });

    it('emits changed on a new target and clears the old list', async () => {
      create();
      model.target = TARGET;
      await refresh();
      expect(model.snapshots.length).toBe(2);
      let changes = 0;
      model.changed.connect(() => (changes += 1));
      model.target = { ...TARGET, path: 'b.ipynb', kernelId: null };
      expect(changes).toBe(1);
      expect(model.snapshots).toEqual([]);
      expect(model.loaded).toBe(false);
    });

    it('does not emit for an equal target or the same showAll', () => {
      create();
      model.target = TARGET;
      let changes = 0;
      model.changed.connect(() => (changes += 1));
      model.target = { ...TARGET };
      model.showAll = false;
      expect(changes).toBe(0);
    });

    it('emits jobStarted, jobChanged and jobFinished once for a job', async () => {
      create();
      const seen: string[] = [];
      model.jobStarted.connect((_, t) => seen.push(`started ${t.job.id}`));
      model.jobChanged.connect((_, t) => seen.push(`changed ${t.job.phase}`));
      model.jobFinished.connect((_, t) =>
        seen.push(`finished ${t.job.status}`)
      );
      let polls = 0;
      server.on('GET', 'jobs/j1', () => {
        polls += 1;
        return {
          body: job('j1', {
            status: polls < 2 ? 'running' : 'done',
            phase: polls < 2 ? 'dumping' : 'done'
          })
        };
      });
      const tracked = model.track(job('j1'));
      const waiting = model.waitFor('j1');
      expect(model.jobsFor('k1')).toEqual([tracked]);
      expect(seen).toEqual(['started j1']);
      // The job is looked at every JOB_POLL_MS, not before.
      await advance(JOB_POLL_MS - 1);
      expect(server.paths()).not.toContain('jobs/j1');
      const changed = signalled(model.jobChanged);
      await advance(1);
      expect(gets('jobs/j1')).toBe(1);
      await changed;
      expect(seen).toEqual(['started j1', 'changed dumping']);
      await advance(JOB_POLL_MS);
      const done = await waiting;
      expect(gets('jobs/j1')).toBe(2);
      expect(done.status).toBe('done');
      expect(seen).toEqual([
        'started j1',
        'changed dumping',
        'changed done',
        'finished done'
      ]);
      expect(model.jobs).toEqual([]);
    });
  });

  describe('requests', () => {
    it('takes a snapshot with POST and follows its job', async () => {
      create();
      server.on('POST', '', { status: 202, body: { job: job('j1') } });
      server.on('GET', 'jobs/j1', {
        body: job('j1', { status: 'done', phase: 'done' })
      });
      const tracked = await model.snapshot('k1');
      expect(server.requests.find(r => r.method === 'POST')).toEqual({
        method: 'POST',
        path: '',
        body: { kernel_id: 'k1' }
      });
      expect(tracked.notify).toBe(true);
      expect(tracked.label).toBe('kernel k1');
      const waiting = model.waitFor('j1');
      await advance(JOB_POLL_MS);
      expect((await waiting).status).toBe('done');
    });

    it('suspends and resumes through the kernel endpoints', async () => {
      create();
      server.on('POST', 'kernels/k1/suspend', {
        status: 202,
        body: { job: job('j2', { kind: 'suspend', status: 'done' }) }
      });
      server.on('POST', 'kernels/k1/resume', {
        status: 202,
        body: { job: job('j3', { kind: 'resume', status: 'done' }) }
      });
      await model.suspend('k1');
      await model.resume('k1');
      expect(server.paths('POST')).toEqual([
        'kernels/k1/suspend',
        'kernels/k1/resume'
      ]);
    });

    it('restores in place or into a notebook with the body the API takes', async () => {
      create();
      server.on('POST', 's1/restore', request => ({
        status: 202,
        body: {
          job: job(`r-${Object.keys(request.body)[0]}`, { status: 'done' })
        }
      }));
      const inPlace = await model.restore('s1', { kernel_id: 'k1' }, 'a');
      const intoPath = await model.restore('s1', { path: 'a.ipynb' });
      expect(server.requests.filter(r => r.method === 'POST')).toEqual([
        { method: 'POST', path: 's1/restore', body: { kernel_id: 'k1' } },
        { method: 'POST', path: 's1/restore', body: { path: 'a.ipynb' } }
      ]);
      expect(inPlace.label).toBe('a');
      expect(intoPath.job.id).toBe('r-path');
    });

    it('takes variables with names and renames', async () => {
      create();
      server.on('POST', 's1/variables', {
        status: 202,
        body: { job: job('v1', { kind: 'variables', status: 'done' }) }
      });
      await model.takeVariables('s1', 'k1', ['x', 'y'], { y: 'y_old' });
      expect(server.requests.find(r => r.method === 'POST')?.body).toEqual({
        kernel_id: 'k1',
        names: ['x', 'y'],
        rename: { y: 'y_old' },
        overwrite: false
      });
    });

    it('previews, undoes and redoes through the kernel endpoints', async () => {
      create();
      server.on('GET', 'kernels/k1/undo?before_cell=c%2F2', {
        body: {
          target: 'cp',
          undone: [],
          not_in_state: [],
          exact: true,
          save: true
        }
      });
      const plan = await model.previewUndo('k1', { before_cell: 'c/2' });
      expect(plan.target).toBe('cp');
      server.on('POST', 'kernels/k1/undo', {
        status: 202,
        body: { job: job('u1', { kind: 'undo', status: 'done' }) }
      });
      server.on('POST', 'kernels/k1/redo', {
        status: 202,
        body: { job: job('u2', { kind: 'redo', status: 'done' }) }
      });
      await model.undo('k1', { to: 'cp' });
      await model.undo('k1', {}, true);
      expect(
        server.requests
          .filter(r => r.method === 'POST')
          .map(r => [r.path, r.body])
      ).toEqual([
        ['kernels/k1/undo', { to: 'cp' }],
        ['kernels/k1/redo', {}]
      ]);
    });

    it("keeps the panel's kernel's checkpoints fresh, and only those", async () => {
      server.on('GET', 'kernels', {
        body: {
          kernels: [
            { ...KERNEL, checkpoints: { enabled: true, position: 'a' } }
          ]
        }
      });
      server.on('GET', 'kernels/k1/checkpoints', {
        body: { kernel_id: 'k1', enabled: true, checkpoints: [{ id: 'a' }] }
      });
      create();
      await refresh();
      expect(model.checkpointsOf('k1')).toBeNull(); // no notebook: nothing asked
      model.target = TARGET;
      await refresh();
      expect(model.checkpointsOf('k1')?.checkpoints.map(c => c.id)).toEqual([
        'a'
      ]);
      model.target = null;
      await refresh();
      expect(model.checkpointsOf('k1')).toBeNull();
    });

    it('deletes a snapshot and drops it from the list at once', async () => {
      create();
      model.target = TARGET;
      await refresh();
      server.on('DELETE', 's3', { status: 204 });
      let changes = 0;
      model.changed.connect(() => (changes += 1));
      await model.delete('s3');
      expect(server.paths('DELETE')).toEqual(['s3']);
      expect(model.snapshots.map(s => s.id)).toEqual(['s2']);
      expect(changes).toBeGreaterThan(0);
    });

    it("fetches one kernel's status and keeps it", async () => {
      create();
      server.on('GET', 'kernels/k2', {
        body: { kernel_id: 'k2', snapshots: false, reason: 'not wrapped' }
      });
      const status = await model.fetchKernelStatus('k2');
      expect(status.reason).toBe('not wrapped');
      expect(model.kernelStatus('k2')).toEqual(status);
    });

    it("rejects a refused request with the server's message and hint", async () => {
      create();
      server.on('POST', 's1/restore', {
        status: 422,
        body: {
          message: 'The snapshot needs a GPU.',
          hint: 'Restore it on a GPU machine.',
          code: 'incompatible'
        }
      });
      const error = await model
        .restore('s1', { kernel_id: 'k1' })
        .catch(e => e as SnapshotAPIError);
      expect(error).toBeInstanceOf(SnapshotAPIError);
      expect(error).toMatchObject({
        message: 'The snapshot needs a GPU.',
        status: 422,
        hint: 'Restore it on a GPU machine.',
        code: 'incompatible'
      });
      expect(model.jobs).toEqual([]);
    });

    it('says what to check when the API is missing or the server is down', async () => {
      server.routes = [];
      const missing = await requestAPI<unknown>(
        'policy',
        {},
        server.settings
      ).catch((e: SnapshotAPIError) => e);
      expect(missing).toMatchObject({ status: 404 });
      server.down = true;
      const down = (await requestAPI<unknown>(
        'policy',
        {},
        server.settings
      ).catch((e: SnapshotAPIError) => e)) as SnapshotAPIError;
      expect(down).toMatchObject({ status: 0 });
      expect(down.message).toMatch(/Cannot reach the Jupyter server/);
      expect(down.hint).toMatch(/still running/);
    });
  });

  describe('refresh and polling', () => {
    it('keeps the error of a failed refresh until one succeeds', async () => {
      create();
      server.on('GET', 'kernels', {
        status: 500,
        body: { message: 'boom', hint: 'look at the log' }
      });
      await refresh();
      expect(refreshes.ended).toBe(1);
      expect(model.loading).toBe(false);
      expect(model.error).toBeInstanceOf(SnapshotAPIError);
      expect(model.error?.message).toBe('boom');
      expect(model.loaded).toBe(false);
      server.routes.shift();
      await refresh();
      expect(model.error).toBeNull();
      expect(model.kernelStatus('k1')).toEqual(KERNEL);
    });

    it('asks for the policy again only on an explicit refresh', async () => {
      create({ settings: { refreshInterval: 5 } });
      await refresh();
      expect(gets('policy')).toBe(1);
      expect(gets('kernels')).toBe(1);
      for (let poll = 2; poll <= 4; poll++) {
        await advance(5000);
        await refreshes.settled();
        expect(gets('kernels')).toBe(poll);
      }
      expect(gets('policy')).toBe(1);
      await refresh();
      expect(gets('policy')).toBe(2);
    });

    it('starts polling by itself unless told not to', async () => {
      create({ auto: true, settings: { refreshInterval: 5 } });
      // (A timer of 0 ms set while timers run is due 1 ms later on jest's clock.)
      await advance(1);
      expect(refreshes.started).toBe(1);
      await refreshes.settled();
      expect(model.loaded).toBe(true);
      model.dispose();
      create({ auto: false });
      await advance(60_000);
      expect(refreshes.started).toBe(0);
    });

    it('polls at the interval of the settings, and on while the server fails', async () => {
      create({ settings: { refreshInterval: 5 } });
      await refresh();
      for (let poll = 2; poll <= 4; poll++) {
        await advance(4999);
        expect(refreshes.started).toBe(poll - 1);
        await advance(1);
        expect(refreshes.started).toBe(poll);
        await refreshes.settled();
      }
      expect(gets('kernels')).toBe(4);
      server.on('GET', 'kernels', { status: 503, body: { message: 'down' } });
      await advance(5000);
      await refreshes.settled();
      expect(gets('kernels')).toBe(5);
      expect(model.error?.message).toBe('down');
      // After a failure it waits at least as long (backoff: a random wait of up to
      // three times the last one), and goes on.
      await advance(4999);
      expect(refreshes.started).toBe(5);
      await nextRefresh(5000, 2);
      expect(gets('kernels')).toBe(6);
      expect(model.error?.message).toBe('down');
      // Back up: the next poll clears the error.
      server.routes.shift();
      await nextRefresh(5000, 9);
      expect(gets('kernels')).toBe(7);
      expect(model.error).toBeNull();
    });

    it('follows a new refresh interval from the settings', async () => {
      create({ settings: { refreshInterval: 60 } });
      await refresh();
      // A new interval refreshes at once, then polls at the new interval (at least 1 s).
      model.settings = { ...model.settings, refreshInterval: 0.2 };
      await advance(0);
      expect(refreshes.started).toBe(2);
      await refreshes.settled();
      await advance(999);
      expect(refreshes.started).toBe(2);
      await advance(1);
      expect(refreshes.started).toBe(3);
      await refreshes.settled();
      await advance(1000);
      expect(refreshes.started).toBe(4);
      await refreshes.settled();
      expect(gets('kernels')).toBe(4);
    });

    it('refreshes every second while a kernel is in a passing state', async () => {
      server.on('GET', 'kernels', {
        body: { kernels: [{ ...KERNEL, state: 'restoring' }] }
      });
      create({ settings: { refreshInterval: 60 } });
      await refresh();
      await advance(999);
      expect(refreshes.started).toBe(1);
      await advance(2);
      expect(refreshes.started).toBe(2);
      await refreshes.settled();
      // Running again: back to the interval of the settings.
      server.routes.shift();
      await advance(1001);
      expect(refreshes.started).toBe(3);
      await refreshes.settled();
      await advance(30_000);
      expect(refreshes.started).toBe(3);
    });

    it('refreshes every second while a snapshot uploads', async () => {
      server.on('GET', '', {
        body: { snapshots: [snapshot('s1', { status: 'uploading' })] }
      });
      create({ settings: { refreshInterval: 60, showAllByDefault: true } });
      await refresh();
      await advance(1001);
      expect(refreshes.started).toBe(2);
      await refreshes.settled();
      server.routes.shift();
      await advance(1001);
      await refreshes.settled();
      await advance(30_000);
      expect(refreshes.started).toBe(3);
    });

    it('drops an answer for a target that is no longer current, and asks again', async () => {
      create();
      const slow = new PromiseDelegate<IAnswer>();
      server.on('GET', '?path=a.ipynb', () => slow.promise);
      server.on('GET', '?path=b.ipynb', {
        body: { snapshots: [snapshot('b1', { notebook_path: 'b.ipynb' })] }
      });
      model.target = { ...TARGET, kernelId: null };
      const first = model.refresh();
      await advance(0);
      expect(server.paths()).toContain('?path=a.ipynb');
      model.target = { ...TARGET, path: 'b.ipynb', kernelId: null };
      // The refresh for b is asked for (debounced) while a's answer is still on the way.
      await advance(1000);
      expect(model.loading).toBe(true);
      expect(refreshes.started).toBe(1);
      expect(server.paths()).not.toContain('?path=b.ipynb');
      slow.resolve({ body: { snapshots: [snapshot('stale')] } });
      await first;
      expect(model.snapshots.map(s => s.id)).not.toContain('stale');
      expect(model.loaded).toBe(false);
      // ... and made once a's answer is in.
      await advance(1000);
      expect(refreshes.started).toBe(2);
      await refreshes.settled();
      expect(server.paths()).toContain('?path=b.ipynb');
      expect(model.loaded).toBe(true);
      expect(model.snapshots.map(s => s.id)).toEqual(['b1']);
    });

    it('follows the running jobs the server reports', async () => {
      create();
      server.on('GET', 'kernels', {
        body: {
          kernels: [{ ...KERNEL, state: 'snapshotting', job: job('p1') }]
        }
      });
      server.on('GET', 'jobs/p1', { body: job('p1', { phase: 'dumping' }) });
      await refresh();
      const [tracked] = model.jobs;
      expect(tracked.job.id).toBe('p1');
      expect(tracked.notify).toBe(false);
      const changed = signalled(model.jobChanged);
      await advance(JOB_POLL_MS);
      expect((await changed).job.phase).toBe('dumping');
    });

    it('refreshes after a job ends', async () => {
      create({ settings: { refreshInterval: 60 } });
      await refresh();
      server.on('GET', 'jobs/j1', { body: job('j1', { status: 'done' }) });
      model.track(job('j1'));
      const waiting = model.waitFor('j1');
      await advance(JOB_POLL_MS);
      await waiting;
      expect(refreshes.started).toBe(1);
      await advance(1000);
      expect(refreshes.started).toBe(2);
      await refreshes.settled();
      expect(gets('kernels')).toBe(2);
    });
  });

  describe('jobs', () => {
    it('marks a job it lost (404) as failed, with what to do', async () => {
      create();
      server.on('GET', 'jobs/j1', { status: 404, body: { message: 'gone' } });
      model.track(job('j1'));
      const waiting = model.waitFor('j1');
      await advance(JOB_POLL_MS);
      const lost = await waiting;
      expect(gets('jobs/j1')).toBe(1);
      expect(lost.status).toBe('failed');
      expect(lost.error?.message).toMatch(/Lost track of the snapshot: gone/);
      expect(lost.error?.hint).toBeTruthy();
    });

    it('keeps following a job through failed polls, up to 60 in a row', async () => {
      create();
      server.on('GET', 'jobs/j1', { status: 502, body: { message: 'proxy' } });
      const tracked = model.track(job('j1'));
      const finished = signalled(model.jobFinished);
      await advance(60 * JOB_POLL_MS);
      expect(gets('jobs/j1')).toBe(60);
      expect(tracked.job.status).toBe('running');
      expect(model.jobs).toEqual([tracked]);
      await advance(JOB_POLL_MS);
      expect((await finished).job.status).toBe('failed');
      expect(tracked.job.error?.message).toBe(
        'Lost track of the snapshot: proxy'
      );
      expect(model.jobs).toEqual([]);
    });

    it('counts the failed polls in a row only', async () => {
      create();
      let polls = 0;
      server.on('GET', 'jobs/j1', () => {
        polls += 1;
        return polls % 40 === 0
          ? { body: job('j1', { phase: 'uploading', done_bytes: polls }) }
          : { status: 502, body: { message: 'proxy' } };
      });
      const tracked = model.track(job('j1'));
      await advance(100 * JOB_POLL_MS);
      expect(polls).toBe(100);
      expect(tracked.job).toMatchObject({ status: 'running', done_bytes: 80 });
    });

    it('finishes at once a job that already ended', async () => {
      create();
      const finished: ITrackedJob[] = [];
      model.jobFinished.connect((_, t) => finished.push(t));
      model.track(job('j1', { status: 'failed' }));
      expect(finished.map(t => t.job.id)).toEqual(['j1']);
      expect(server.paths()).not.toContain('jobs/j1');
    });

    it('merges a job followed twice', () => {
      create();
      server.on('GET', 'jobs/j1', { body: job('j1') });
      const a = model.track(job('j1'));
      const b = model.track(job('j1', { phase: 'dumping' }), {
        notify: true,
        label: 'a.ipynb'
      });
      expect(b).toBe(a);
      expect(a).toMatchObject({ notify: true, label: 'a.ipynb' });
      expect(a.job.phase).toBe('dumping');
      expect(model.jobs.length).toBe(1);
    });

    it('refuses to wait for a job it does not follow', async () => {
      create();
      await expect(model.waitFor('nope')).rejects.toThrow(/not followed/);
    });

    it('names a job after its kernel with kernelLabel', () => {
      create();
      server.on('GET', 'jobs/j1', { body: job('j1') });
      model.kernelLabel = id => `notebook of ${id}`;
      expect(model.track(job('j1')).label).toBe('notebook of k1');
    });
  });

  describe('server events', () => {
    it('follows a job started elsewhere, without notifying', () => {
      create();
      server.on('GET', 'jobs/p1', { body: job('p1') });
      emit({
        action: 'started',
        job_id: 'p1',
        kind: 'suspend',
        kernel_id: 'k1'
      });
      const [tracked] = model.jobs;
      expect(tracked.job).toMatchObject({
        id: 'p1',
        kind: 'suspend',
        status: 'running'
      });
      expect(tracked.notify).toBe(false);
    });

    it('takes progress from events', () => {
      create();
      server.on('GET', 'jobs/j1', { body: job('j1') });
      const tracked = model.track(job('j1'));
      const phases: string[] = [];
      model.jobChanged.connect((_, t) => phases.push(t.job.phase));
      emit({
        action: 'progress',
        job_id: 'j1',
        phase: 'uploading',
        done_bytes: 10,
        total_bytes: 40
      });
      expect(phases).toEqual(['uploading']);
      expect(tracked.job).toMatchObject({ done_bytes: 10, total_bytes: 40 });
    });

    it('ignores the events of other schemas', () => {
      create();
      events.stream.emit({
        schema_id: 'https://events.jupyter.org/other',
        action: 'started',
        job_id: 'x'
      } as unknown as Event.Emission);
      expect(model.jobs).toEqual([]);
    });

    it('refreshes soon after an event', async () => {
      create();
      emit({ action: 'deleted', snapshot_id: 's1' });
      expect(refreshes.started).toBe(0);
      await advance(1000);
      expect(refreshes.started).toBe(1);
      await refreshes.settled();
      expect(server.paths()).toContain('kernels');
    });
  });

  describe('one story per job', () => {
    it('never goes back to an earlier phase, nor says done while it runs', () => {
      create();
      server.on('GET', 'jobs/j1', { body: job('j1') });
      const tracked = model.track(job('j1', { phase: 'dumping' }));
      const phases: string[] = [];
      model.jobChanged.connect((_, t) => phases.push(t.job.phase));
      for (const phase of [
        'hashing',
        'dumping',
        'done',
        'storing',
        'hashing'
      ]) {
        emit({ action: 'progress', job_id: 'j1', phase });
      }
      expect(phases).toEqual(['hashing', 'storing']);
      expect(tracked.job.phase).toBe('storing');
    });

    it('hears nothing more of a job once it has ended', async () => {
      create();
      server.on('GET', 'jobs/j1', {
        body: job('j1', { status: 'done', phase: 'done' })
      });
      model.track(job('j1', { phase: 'storing' }), { notify: true });
      await advance(JOB_POLL_MS);
      expect(model.jobs).toEqual([]);
      const started: ITrackedJob[] = [];
      model.jobStarted.connect((_, t) => started.push(t));
      // A progress event sent before the end, arriving after it.
      emit({
        action: 'progress',
        job_id: 'j1',
        phase: 'storing',
        kind: 'snapshot'
      });
      // A listing from before the end, with the job running.
      model.track(job('j1', { phase: 'storing' }));
      expect(started).toEqual([]);
      expect(model.jobs).toEqual([]);
    });
  });

  describe('a kernel that died, a server that went away', () => {
    it("lists the snapshots of the notebook's kernel's lineage too", async () => {
      server.on('GET', 'kernels', {
        body: { kernels: [{ ...KERNEL, lineage: 'old lineage' }] }
      });
      server.on('GET', '?lineage=old%20lineage', {
        body: {
          snapshots: [
            snapshot('s7', {
              created: '2026-12-01T09:00:00Z',
              notebook_path: 'Untitled.ipynb'
            })
          ]
        }
      });
      create();
      model.target = TARGET;
      await refresh();
      expect(model.snapshots.map(s => s.id)).toEqual(['s3', 's2', 's7']);
    });

    it("dismisses a kernel's death with PATCH", async () => {
      create();
      server.on('PATCH', 'kernels/k1', { body: { ...KERNEL, death: null } });
      await model.dismissDeath('k1');
      expect(server.requests.find(r => r.method === 'PATCH')?.body).toEqual({
        dismiss_death: true
      });
      expect(model.kernelStatus('k1')?.death).toBeNull();
    });

    it('says when the server cannot be reached, tries often, and says when it is back', async () => {
      create({ auto: true, settings: { refreshInterval: 60 } });
      await advance(1);
      await refreshes.settled();
      expect(model.unreachableSince).toBeNull();
      server.down = true;
      await nextRefresh(1000, 61);
      expect(model.unreachableSince).toBeInstanceOf(Date);
      // Tried every 2 s while it cannot be reached, not after minutes of backoff.
      await nextRefresh(1000, 3);
      await nextRefresh(1000, 3);
      const back = signalled(model.reconnected);
      server.down = false;
      await nextRefresh(1000, 3);
      await back;
      expect(model.unreachableSince).toBeNull();
      // Then at the settings' pace again.
      const before = refreshes.started;
      await advance(30_000);
      expect(refreshes.started).toBe(before);
    });

    it("takes JupyterLab's word that the connection is lost", () => {
      create();
      const changed = signalled(model.changed);
      model.connectionLost();
      expect(model.unreachableSince).toBeInstanceOf(Date);
      return changed;
    });
  });

  describe('dispose', () => {
    it('stops polling and listening, and lets waiters go', async () => {
      create({ auto: true, settings: { refreshInterval: 5 } });
      server.on('GET', 'jobs/j1', { body: job('j1') });
      await advance(1);
      await refreshes.settled();
      expect(refreshes.started).toBe(1);
      model.track(job('j1'));
      const waiting = model.waitFor('j1');
      model.target = TARGET;
      model.dispose();
      expect(model.isDisposed).toBe(true);
      expect((await waiting).status).toBe('running');
      const count = server.requests.length;
      emit({ action: 'started', job_id: 'p2' });
      await advance(60_000);
      expect(server.requests.length).toBe(count);
      expect(model.jobs).toEqual([]);
      // No timer of the model is left behind.
      expect(jest.getTimerCount()).toBe(0);
      model.dispose();
    });
  });
});
