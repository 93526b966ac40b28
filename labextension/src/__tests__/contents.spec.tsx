/**
 * What an expanded card says of a snapshot of a kernel whose language cannot give all
 * (docs/kernels.md): an R kernel's variables are listed but cannot be taken back, a
 * xeus-python kernel's are not recorded; the reason is said in place of the missing part.
 */
import { ReactWidget } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import * as React from 'react';

import { ContentsDetails } from '../components/Contents';
import type { IContents, ISnapshot, ISnapshotsModel } from '../tokens';

const R_TAKE =
  'Taking variables back is not available for R kernels: it pickles them with Python in a copy of the snapshot’s kernel.';
const XEUS_VARIABLES =
  'Variables are not recorded for xeus-python kernels: only Python (ipykernel) and R kernels are read.';

let widget: Widget | null = null;

beforeAll(() => {
  // React's act() warns outside a test environment that declares it.
  (
    globalThis as { IS_REACT_ACT_ENVIRONMENT?: boolean }
  ).IS_REACT_ACT_ENVIRONMENT = true;
});

async function details(contents: IContents): Promise<Widget> {
  const snapshot = { id: 's1', contents } as ISnapshot;
  const model = {
    details: async () => snapshot
  } as unknown as ISnapshotsModel;
  widget = ReactWidget.create(
    <ContentsDetails
      model={model}
      snapshotId="s1"
      takeBlocked=""
      onTake={() => undefined}
    />
  );
  await React.act(async () => {
    Widget.attach(widget!, document.body);
    await (widget as ReactWidget).renderPromise;
  });
  await React.act(async () => undefined); // the details' promise
  return widget;
}

afterEach(async () => {
  // Unmounting renders too: inside act(), as the mounting.
  await React.act(async () => widget?.dispose());
  widget = null;
});

const df = { name: 'df', type: 'data.frame', size: 12848, shape: [1000, 2] };

describe('contents of a snapshot of another kernel than ipykernel', () => {
  it('lists an R kernel’s variables and says why they cannot be taken back', async () => {
    const node = (
      await details({
        language: 'R',
        variables: [df],
        take_unavailable: R_TAKE
      })
    ).node;
    expect(node.textContent).toContain('df');
    expect(node.textContent).toContain('data.frame'); // an R class, not shortened
    expect(node.textContent).toContain(R_TAKE);
    expect(node.querySelector('input[aria-label="Take df"]')).toBeNull();
    expect(node.querySelector('.jp-KernelSnapshots-takeVariables')).toBeNull();
  });

  it('says why a xeus-python kernel’s variables are not recorded', async () => {
    const node = (
      await details({
        variables: [],
        variables_unavailable: XEUS_VARIABLES,
        take_unavailable: R_TAKE
      })
    ).node;
    expect(node.textContent).toContain(XEUS_VARIABLES);
    expect(node.textContent).not.toContain('Variables: 0');
  });

  it('offers an ipykernel kernel’s variables to take back', async () => {
    const node = (await details({ variables: [df] })).node;
    expect(node.querySelector('input[aria-label="Take df"]')).not.toBeNull();
    expect(
      node.querySelector('.jp-KernelSnapshots-takeVariables')
    ).not.toBeNull();
  });
});
