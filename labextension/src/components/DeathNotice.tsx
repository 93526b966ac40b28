/**
 * A kernel that died, said where it happened: at the top of its notebook (and in the
 * panel), with the reason, the snapshot offered back and the cells a restore would not
 * bring back; Restore or keep the new kernel. A kernel without a snapshot says so once.
 */
import { ReactWidget, UseSignal } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import * as React from 'react';

import { IActionContext, restoreOffered } from '../actions';
import { formatClock, formatTrigger, parseDate } from '../format';
import type { IKernelDeath } from '../tokens';
import { ActionButton, useNow } from './common';

/** "3 cells earlier", "at least 3 cells earlier", "nothing ran since". */
function cellsEarlier(death: IKernelDeath): string {
  const count = death.cells_since.length;
  if (count === 0 && death.cells_since_exact) {
    return 'nothing ran since';
  }
  const cells = `${count} cell${count === 1 ? '' : 's'} earlier`;
  return death.cells_since_exact ? cells : `at least ${cells}`;
}

/** What the death notice says and offers, for a kernel of a notebook. */
export function DeathCallout(props: {
  death: IKernelDeath;
  /** Restore the offered snapshot into the kernel (null: no restore can start here). */
  onRestore: (() => Promise<unknown>) | null;
  onDismiss: () => Promise<unknown>;
}): JSX.Element {
  const { death } = props;
  const now = useNow();
  const [busy, setBusy] = React.useState(false);
  const act = (action: () => Promise<unknown>) => {
    setBusy(true);
    void action().finally(() => setBusy(false));
  };
  const when = formatClock(parseDate(death.snapshot_created), now);
  const restore = death.restore;
  let question: string;
  let buttons: JSX.Element[];
  const ok = (
    <ActionButton
      key="ok"
      kind="accept"
      disabled={busy}
      onClick={() => act(props.onDismiss)}
    >
      OK
    </ActionButton>
  );
  if (!death.snapshot_id) {
    question =
      'It had no snapshot, so what it held is lost; it runs again as a new kernel.';
    buttons = [ok];
  } else if (restore?.automatic && restore.status === 'running') {
    question = `Restoring its snapshot from ${when} (${cellsEarlier(death)})…`;
    buttons = [];
  } else if (restore?.automatic && restore.status === 'done') {
    question = `Its snapshot from ${when} was restored (${cellsEarlier(death)}).`;
    buttons = [ok];
  } else {
    question =
      restore?.automatic && restore.status === 'failed'
        ? `Restoring its snapshot from ${when} failed. Try again (${cellsEarlier(death)})?`
        : `Restore its snapshot from ${when}, ${cellsEarlier(death)}?`;
    buttons = [
      <ActionButton
        key="keep"
        disabled={busy}
        title="Keep the new, empty kernel jupyter_client started (the snapshot stays in the panel)"
        onClick={() => act(props.onDismiss)}
      >
        Keep the new kernel
      </ActionButton>,
      <ActionButton
        key="restore"
        kind="accept"
        disabled={busy || props.onRestore === null}
        title={`Restore the snapshot from ${when} (${formatTrigger(death.snapshot_trigger)}) into this notebook's kernel`}
        onClick={() => props.onRestore && act(props.onRestore)}
      >
        Restore snapshot
      </ActionButton>
    ];
  }
  const lost = death.cells_since;
  return (
    <div
      className="jp-KernelSnapshots-death"
      role="alert"
      aria-label="The kernel died"
    >
      <div className="jp-KernelSnapshots-deathText">
        <strong>The kernel died ({death.reason}).</strong> {question}
      </div>
      {lost.length > 0 && (
        <div className="jp-KernelSnapshots-deathCells">
          <span className="jp-KernelSnapshots-dim">
            {death.snapshot_id
              ? 'Not in the snapshot:'
              : 'Run since it started:'}
          </span>
          <ol aria-label="Cells run since the snapshot">
            {lost.map((cell, index) => (
              <li key={index}>
                <code>
                  [{cell.execution_count ?? ' '}] {cell.first_line}
                </code>
              </li>
            ))}
          </ol>
        </div>
      )}
      {buttons.length > 0 && (
        <div className="jp-KernelSnapshots-deathActions">{buttons}</div>
      )}
    </div>
  );
}

/**
 * The notice at the top of a notebook whose kernel died (its content header). The header
 * is a Lumino box: it is as tall as its widgets' minimum height, which follows the notice
 * as it renders and grows (cells listed, buttons) or goes.
 */
export class DeathNotice extends ReactWidget {
  constructor(
    private _context: IActionContext,
    private _panel: NotebookPanel
  ) {
    super();
    this.addClass('jp-KernelSnapshots-deathNotice');
    this._resize = new ResizeObserver(() => this._fitToContent());
  }

  dispose(): void {
    this._resize.disconnect();
    super.dispose();
  }

  render(): JSX.Element {
    const { model } = this._context;
    return (
      <div
        className="jp-KernelSnapshots-deathBox"
        ref={element => this._observe(element)}
      >
        <UseSignal signal={model.changed}>
          {() => {
            const kernelId = this._panel.sessionContext.session?.kernel?.id;
            const death = kernelId ? model.kernelStatus(kernelId)?.death : null;
            if (!kernelId || !death) {
              return null;
            }
            return (
              <DeathCallout
                death={death}
                onRestore={
                  death.snapshot_id
                    ? () =>
                        restoreOffered(
                          this._context,
                          this._panel,
                          kernelId,
                          death
                        )
                    : null
                }
                onDismiss={() => model.dismissDeath(kernelId)}
              />
            );
          }}
        </UseSignal>
      </div>
    );
  }

  private _observe(element: HTMLElement | null): void {
    this._resize.disconnect();
    if (element) {
      this._resize.observe(element);
    }
  }

  /** The box's height is the notice's (0 without one): tell the layout. */
  private _fitToContent(): void {
    const box = this.node.firstElementChild as HTMLElement | null;
    const height = box ? Math.ceil(box.getBoundingClientRect().height) : 0;
    if (this.node.style.minHeight !== `${height}px`) {
      this.node.style.minHeight = `${height}px`;
      this.parent?.fit();
    }
  }

  private _resize: ResizeObserver;
}
