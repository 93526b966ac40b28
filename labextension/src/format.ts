/**
 * Human-readable sizes, times, triggers and policies.
 */
import type { IJob, IPolicy, ISnapshot, Phase } from './tokens';

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** 1536 -> "1.5 KiB", 0 -> "0 B". */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '?';
  }
  let value = Math.max(0, bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  if (unit === 0) {
    return `${value} B`;
  }
  const digits = value >= 100 ? 0 : 1;
  return `${value.toFixed(digits)} ${UNITS[unit]}`;
}

/** The time of an ISO date string, or null if it does not parse. */
export function parseDate(value: string | null | undefined): Date | null {
  if (!value) {
    return null;
  }
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? null : date;
}

/** "just now", "42 s ago", "3 min ago", "2 h ago", "yesterday", "5 days ago", or a date. */
export function formatRelative(date: Date | null, now: number = Date.now()) {
  if (!date) {
    return 'unknown time';
  }
  const seconds = Math.round((now - date.getTime()) / 1000);
  if (seconds < 0) {
    return 'just now';
  }
  if (seconds < 10) {
    return 'just now';
  }
  if (seconds < 60) {
    return `${seconds} s ago`;
  }
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) {
    return `${minutes} min ago`;
  }
  const hours = Math.floor(minutes / 60);
  if (hours < 24) {
    return `${hours} h ago`;
  }
  const days = Math.floor(hours / 24);
  if (days === 1) {
    return 'yesterday';
  }
  if (days < 30) {
    return `${days} days ago`;
  }
  return formatClock(date, now);
}

/**
 * The one date format: "22:13" today, "Dec 3, 22:13" another day, "Dec 3 2025, 22:13"
 * another year (24-hour, the browser's language); with `seconds`, "22:13:05".
 */
export function formatClock(
  date: Date | null,
  now: number = Date.now(),
  seconds = false
): string {
  if (!date) {
    return '';
  }
  const time = date.toLocaleTimeString(undefined, {
    hour: '2-digit',
    minute: '2-digit',
    second: seconds ? '2-digit' : undefined,
    hour12: false
  });
  const today = new Date(now);
  if (today.toDateString() === date.toDateString()) {
    return time;
  }
  const day = date.toLocaleDateString(undefined, {
    month: 'short',
    day: 'numeric',
    year: date.getFullYear() === today.getFullYear() ? undefined : 'numeric'
  });
  return `${day}, ${time}`;
}

/** The full date and time for a tooltip, in the same format: "Dec 4, 2026, 22:13:05". */
export function formatAbsolute(date: Date | null, now: number = -1): string {
  // Never "today" alone: a tooltip names the day.
  return formatClock(date, now, true);
}

/** 90 -> "1 min 30 s", 1800 -> "30 min", 7200 -> "2 h". */
export function formatDuration(seconds: number): string {
  if (seconds < 1) {
    return `${Math.round(seconds * 1000)} ms`;
  }
  if (seconds < 60) {
    return `${+seconds.toFixed(seconds < 10 ? 2 : 0)} s`;
  }
  const minutes = Math.floor(seconds / 60);
  const rest = Math.round(seconds % 60);
  if (minutes < 60) {
    return rest ? `${minutes} min ${rest} s` : `${minutes} min`;
  }
  const hours = Math.floor(minutes / 60);
  const restMinutes = minutes % 60;
  return restMinutes ? `${hours} h ${restMinutes} min` : `${hours} h`;
}

const TRIGGERS: { [key: string]: string } = {
  manual: 'manual',
  periodic: 'periodic',
  'long-cell': 'after a long cell',
  'idle-suspend': 'idle suspend',
  cull: 'idle cull',
  'admin-shutdown': 'shut down by an admin',
  'before-shutdown': 'before shutdown',
  'before-restore': 'before a restore',
  start: 'cell checkpoint: kernel start',
  cell: 'cell checkpoint',
  'before-undo': 'cell checkpoint: before an undo',
  'before-redo': 'cell checkpoint: before a redo'
};

/** "idle-suspend" -> "idle suspend". */
export function formatTrigger(trigger: string | null | undefined): string {
  if (!trigger) {
    return 'unknown';
  }
  return TRIGGERS[trigger] ?? trigger.replace(/-/g, ' ');
}

const STATUSES: { [key: string]: string } = {
  complete: 'complete',
  uploading: 'uploading',
  'upload-failed': 'upload failed'
};

/**
 * A snapshot's status in words. The API's "uploading" is a snapshot on its way into the
 * store: an upload into S3, but "storing" into a local store (`store`, the policy's).
 */
export function formatStatus(
  status: string | null | undefined,
  store?: string
): string {
  if (!status) {
    return 'unknown';
  }
  if (store && store !== 's3') {
    if (status === 'uploading') {
      return 'storing';
    }
    if (status === 'upload-failed') {
      return 'not stored';
    }
  }
  return STATUSES[status] ?? status.replace(/-/g, ' ');
}

/** The GPU models a snapshot used, e.g. "NVIDIA H200". */
export function gpuModels(snapshot: ISnapshot): string {
  const gpus = snapshot.gpu?.gpus ?? [];
  const used = new Set(snapshot.gpu?.used_gpus ?? []);
  const chosen = gpus.filter(gpu => gpu.uuid && used.has(gpu.uuid));
  const names = new Set(
    (chosen.length ? chosen : gpus.slice(0, 1))
      .map(gpu => gpu.name)
      .filter((name): name is string => !!name)
  );
  return [...names].join(', ');
}

/** The file name of a notebook path. */
export function baseName(path: string | null | undefined): string {
  if (!path) {
    return '';
  }
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

const PHASES: Record<Phase, string> = {
  queued: 'Waiting',
  'releasing-gpu-caches': 'Releasing GPU caches',
  'gpu-checkpoint': 'Checkpointing GPU memory',
  comparing: 'Finding what memory changed',
  dumping: 'Dumping memory',
  hashing: 'Hashing',
  uploading: 'Uploading',
  storing: 'Storing',
  committing: 'Committing',
  'checking-cache': 'Checking the local copy',
  downloading: 'Downloading',
  verifying: 'Verifying',
  'saving-kernel': 'Saving the running kernel',
  restoring: 'Restoring',
  transferring: 'Bringing memory in',
  serialising: 'Pickling the variables',
  loading: 'Loading them into the kernel',
  checking: 'Checking the store',
  'reading-data': 'Reading every chunk',
  pruning: 'Removing what nothing needs',
  done: 'Done'
};

const KINDS: { [key: string]: string } = {
  snapshot: 'Snapshot',
  restore: 'Restore',
  suspend: 'Suspend',
  resume: 'Resume',
  variables: 'Take variables',
  check: 'Store check',
  prune: 'Store prune'
};

/** "Snapshot", "Restore"... */
export function formatKind(kind: string): string {
  return KINDS[kind] ?? kind;
}

/** Phases whose bytes count the memory image (what CRIU wrote), not what is stored. */
const IMAGE_PHASES = new Set<string>(['uploading', 'storing', 'committing']);

/** "dumping memory", "storing 12.0 MiB of the 40.0 MiB image (30%)". */
export function formatPhase(job: IJob): string {
  const phase = (
    PHASES[job.phase as Phase] ?? String(job.phase).replace(/-/g, ' ')
  ).toLowerCase();
  if (job.total_bytes > 0 && job.phase !== 'done') {
    const percent = Math.floor((100 * job.done_bytes) / job.total_bytes);
    const of = IMAGE_PHASES.has(job.phase)
      ? `of the ${formatBytes(job.total_bytes)} image`
      : `of ${formatBytes(job.total_bytes)}`;
    return `${phase} ${formatBytes(job.done_bytes)} ${of} (${percent}%)`;
  }
  return phase;
}

/** "Snapshot: dumping memory": what the panel, the toolbar and a notification say. */
export function describeJob(job: IJob): string {
  return `${formatKind(job.kind)}: ${formatPhase(job)}`;
}

/**
 * A snapshot's sizes, each named: "image 232 MiB, stored as 202 MiB, 3.1 MiB new". The
 * image is the kernel's memory as CRIU wrote it; the store keeps it compressed and
 * shares chunks with other snapshots.
 */
export function formatSizes(snapshot: {
  total_bytes?: number;
  stored_bytes?: number;
  new_bytes?: number;
}): string {
  const parts = [`image ${formatBytes(snapshot.total_bytes)}`];
  if (snapshot.stored_bytes !== undefined) {
    parts.push(`stored as ${formatBytes(snapshot.stored_bytes)}`);
  }
  if (snapshot.new_bytes !== undefined) {
    parts.push(`${formatBytes(snapshot.new_bytes)} new`);
  }
  return parts.join(', ');
}

/** The fraction of the job done, when it reports bytes (null otherwise). */
export function jobFraction(job: IJob): number | null {
  if (job.total_bytes > 0) {
    return Math.min(1, Math.max(0, job.done_bytes / job.total_bytes));
  }
  return null;
}

/** The policy as label/value pairs for the panel. */
export function policyLines(policy: IPolicy): [string, string][] {
  const lines: [string, string][] = [];
  const store = policy.store ?? 'local';
  lines.push([
    store === 's3'
      ? 'Store (S3)'
      : store === 'local'
        ? 'Store (local directory)'
        : `Store (${store})`,
    policy.location || String(store)
  ]);
  const periodic = policy.periodic_interval ?? 0;
  lines.push([
    'Periodic snapshots',
    periodic > 0
      ? `every ${formatDuration(periodic)} (kernels that ran something)`
      : 'off'
  ]);
  const longCell = policy.long_cell_seconds ?? 0;
  lines.push([
    'After long cells',
    longCell > 0
      ? `a snapshot after a cell of ${formatDuration(longCell)} or more (at most every ${formatDuration(policy.long_cell_min_interval ?? 0)})`
      : 'off'
  ]);
  const keep = policy.keep_last ?? 0;
  const hourly = policy.keep_hourly_hours ?? 0;
  const daily = policy.keep_daily_days ?? 0;
  lines.push([
    'Kept per notebook',
    keep > 0
      ? `last ${keep}` +
        (hourly > 0 ? `, then one per hour for ${hourly} h` : '') +
        (daily > 0 ? `, one per day for ${daily} days` : '') +
        ' (the newest is never deleted)'
      : 'all'
  ]);
  const budget = policy.max_store_bytes ?? 0;
  lines.push(['Store budget', budget > 0 ? formatBytes(budget) : 'none']);
  const checkpoints = policy.cell_checkpoints as string | undefined;
  if (checkpoints) {
    const max = Number(policy.cell_checkpoints_max_bytes ?? -1);
    lines.push([
      'Cell checkpoints (undo)',
      checkpoints === 'off'
        ? 'off'
        : `${checkpoints === 'auto' ? 'where cheap (not GPU kernels)' : 'every kernel'}, ` +
          `the last ${policy.cell_checkpoints_keep ?? 20} per kernel within ` +
          (max >= 0 ? formatBytes(max) : 'a tenth of the disk')
    ]);
  }
  const idle = policy.idle_suspend_after ?? 0;
  lines.push([
    'Idle suspend',
    idle > 0
      ? `after ${formatDuration(idle)} idle (${
          policy.suspend_cpu_kernels ? 'all kernels' : 'GPU kernels only'
        })`
      : 'off'
  ]);
  const cull = policy.cull_idle_timeout ?? 0;
  if (cull > 0) {
    lines.push([
      'Kernel culler',
      `after ${formatDuration(cull)} idle: ` +
        (policy.cull_action === 'shutdown'
          ? 'shut down, state lost'
          : 'suspended, state kept')
    ]);
  }
  lines.push([
    'Before server shutdown',
    policy.snapshot_before_shutdown ? 'snapshot every kernel' : 'no snapshot'
  ]);
  if (policy.key_notice) {
    lines.push(['Encryption key', policy.key_notice]);
  }
  return lines;
}
