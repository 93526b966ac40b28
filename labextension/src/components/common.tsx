import * as React from 'react';

import { formatKind, formatPhase, jobFraction } from '../format';
import type { IJob } from '../tokens';

/** The current time, updated every `intervalMs` (for "3 min ago"). */
export function useNow(intervalMs = 30000): number {
  const [now, setNow] = React.useState(Date.now());
  React.useEffect(() => {
    const timer = window.setInterval(() => setNow(Date.now()), intervalMs);
    return () => window.clearInterval(timer);
  }, [intervalMs]);
  return now;
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

/** A job in progress: "Snapshot: Uploading 3.0 MiB of 10.0 MiB" and a bar. */
export function JobProgress(props: { job: IJob }): JSX.Element {
  const { job } = props;
  const text = `${formatKind(job.kind)}: ${formatPhase(job)}`;
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
