/**
 * The page's one clock: relative times in separate React roots (the panel, a dialog
 * beside it) tick together, in the same task, so no one can read them apart.
 */
import * as React from 'react';
import { act } from 'react';
import { createRoot, Root } from 'react-dom/client';

import { RelativeTime } from '../components/common';

describe('RelativeTime', () => {
  const taken = new Date(2026, 11, 7, 12, 0, 0).getTime();
  let roots: Root[] = [];
  let hosts: HTMLElement[] = [];

  beforeEach(() => {
    jest.useFakeTimers({ now: taken + 20_200 });
  });

  afterEach(() => {
    inAct(() => roots.forEach(root => root.unmount()));
    hosts.forEach(host => host.remove());
    roots = [];
    hosts = [];
    jest.useRealTimers();
  });

  /** Set-up and tear-down in `act`; the ticks outside it, as in the browser. */
  function inAct(work: () => void): void {
    (globalThis as any).IS_REACT_ACT_ENVIRONMENT = true;
    act(work);
    (globalThis as any).IS_REACT_ACT_ENVIRONMENT = false;
  }

  function mount(): HTMLElement {
    const host = document.createElement('div');
    document.body.appendChild(host);
    const root = createRoot(host);
    inAct(() =>
      root.render(<RelativeTime iso={new Date(taken).toISOString()} />)
    );
    roots.push(root);
    hosts.push(host);
    return host;
  }

  it('shows every root the new second in the tick that made it', () => {
    const panel = mount();
    const dialog = mount();
    expect(panel.textContent).toBe('20 s ago');
    expect(dialog.textContent).toBe('20 s ago');
    for (const shown of ['21 s ago', '22 s ago', '23 s ago']) {
      // Only the clock's timer runs: nothing else may render the roots before we read.
      jest.advanceTimersByTime(1000);
      expect([panel.textContent, dialog.textContent]).toEqual([shown, shown]);
    }
  });
});
