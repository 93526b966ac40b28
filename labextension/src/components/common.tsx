import * as React from 'react';
import { flushSync } from 'react-dom';

import {
  describeJob,
  formatAbsolute,
  formatRelative,
  jobFraction,
  parseDate
} from '../format';
import type { IJob } from '../tokens';

/**
 * One clock for every relative time on the page ("42 s ago"), ticking each second while
 * something shows one: the panel, a dialog and a notice beside it never disagree. They are
 * separate React roots, each rendered in a task of its own, so a tick renders them all at
 * once (`flushSync`): otherwise a busy page shows the panel a second ahead of the dialog
 * until the next task.
 */
const clock = {
  now: Date.now(),
  listeners: new Set<(now: number) => void>(),
  timer: 0
};

function subscribe(listener: (now: number) => void): () => void {
  clock.listeners.add(listener);
  if (clock.timer === 0) {
    clock.now = Date.now();
    clock.timer = window.setInterval(() => {
      clock.now = Date.now();
      flushSync(() => clock.listeners.forEach(l => l(clock.now)));
    }, 1000);
  }
  return () => {
    clock.listeners.delete(listener);
    if (clock.listeners.size === 0) {
      window.clearInterval(clock.timer);
      clock.timer = 0;
    }
  };
}

/**
 * The page's clock (see above), in ms. Subscribed as the view is committed, then set to
 * the clock's time: a tick between its render and its subscription would otherwise leave
 * it a second behind the views already there (a dialog opened beside the panel).
 */
export function useNow(): number {
  const [now, setNow] = React.useState(clock.timer ? clock.now : Date.now());
  React.useLayoutEffect(() => {
    const unsubscribe = subscribe(setNow);
    setNow(clock.now);
    return unsubscribe;
  }, []);
  return now;
}

/** "42 s ago", ticking, with the date in the one format as its tooltip. */
export function RelativeTime(props: {
  iso: string | null | undefined;
  className?: string;
}): JSX.Element {
  const now = useNow();
  const date = parseDate(props.iso);
  return (
    <time
      className={props.className}
      dateTime={props.iso ?? undefined}
      title={formatAbsolute(date)}
    >
      {formatRelative(date, now)}
    </time>
  );
}

/** A progress bar: determinate with a fraction, indeterminate without. */
export function ProgressBar(props: {
  fraction: number | null;
  label: string;
}): JSX.Element {
  const { fraction, label } = props;
  return (
    <div
      className={
        'jp-KernelSnapshots-progress' +
        (fraction === null ? ' jp-mod-indeterminate' : '')
      }
      role="progressbar"
      aria-label={label}
      aria-valuemin={0}
      aria-valuemax={100}
      aria-valuenow={fraction === null ? undefined : Math.round(fraction * 100)}
    >
      <div
        className="jp-KernelSnapshots-progressBar"
        style={fraction === null ? undefined : { width: `${fraction * 100}%` }}
      />
    </div>
  );
}

/** A job in progress: "Snapshot: storing 3.0 MiB of the 10.0 MiB image" and a bar. */
export function JobProgress(props: { job: IJob }): JSX.Element {
  const { job } = props;
  const text = describeJob(job);
  return (
    <div className="jp-KernelSnapshots-job" role="status">
      <div className="jp-KernelSnapshots-jobText">{text}</div>
      <ProgressBar fraction={jobFraction(job)} label={text} />
    </div>
  );
}

const STATE_LABELS: { [state: string]: string } = {
  starting: 'starting',
  running: 'running',
  snapshotting: 'snapshotting…',
  restoring: 'restoring…',
  dead: 'dead',
  suspended: 'suspended',
  stopping: 'stopping'
};

/** A small coloured badge for a kernel's snapshot state. */
export function StateBadge(props: { state: string }): JSX.Element {
  const { state } = props;
  return (
    <span
      className={`jp-KernelSnapshots-badge jp-KernelSnapshots-state jp-mod-${state}`}
    >
      {STATE_LABELS[state] ?? state}
    </span>
  );
}

/** A boxed message: info, warning or error, with optional actions. */
export function Callout(props: {
  kind: 'info' | 'warning' | 'error';
  title?: string;
  children?: React.ReactNode;
}): JSX.Element {
  return (
    <div
      className={`jp-KernelSnapshots-callout jp-mod-${props.kind}`}
      role={props.kind === 'error' ? 'alert' : 'note'}
    >
      {props.title && (
        <div className="jp-KernelSnapshots-calloutTitle">{props.title}</div>
      )}
      {props.children}
    </div>
  );
}

/** A compact button in the JupyterLab dialog colours: accept (blue), secondary, warn... */
export function ActionButton(
  props: React.ButtonHTMLAttributes<HTMLButtonElement> & {
    kind?: 'accept' | 'secondary' | 'minimal' | 'danger';
  }
): JSX.Element {
  const { kind = 'secondary', className, ...rest } = props;
  return (
    <button
      type="button"
      className={`jp-KernelSnapshots-button jp-mod-${kind}${className ? ` ${className}` : ''}`}
      {...rest}
    />
  );
}
