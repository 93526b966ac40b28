/**
 * Every state the panel can show, for the screenshots: the snapshot API answers are mocked
 * (GPU snapshots, uploads in progress or failed, a snapshot job with its progress, a
 * suspended kernel, the whole store, an unreachable store). The notebook's kernel is real.
 */
import { expect } from '@jupyterlab/galata';
import type { Locator, Route } from '@playwright/test';
import * as path from 'path';

import {
  currentKernelId,
  openSnapshotsPanel,
  SCREENSHOTS,
  shutDownSessions,
  SNAPSHOT_KERNEL,
  test,
  waitForToasts,
  snapshotCards
} from './helpers';

test.use({ autoGoto: false });
test.afterEach(async ({ request }) => shutDownSessions(request));

const MiB = 1024 * 1024;
const GiB = 1024 * MiB;
const LINEAGE = '5a1e7c0ffee0a11e';

function ago(seconds: number): string {
  return new Date(Date.now() - seconds * 1000).toISOString();
}

function snapshot(fields: { [key: string]: unknown }) {
  return {
    id: Math.random().toString(16).slice(2).padEnd(32, '0').slice(0, 32),
    lineage: LINEAGE,
    sequence: 1,
    created: ago(60),
    trigger: 'manual',
    status: 'complete',
    error: '',
    notebook_path: 'gallery.ipynb',
    kernel_id: null,
    kernel_spec: { name: SNAPSHOT_KERNEL },
    host: 'gpu-node-7',
    total_bytes: 512 * MiB,
    stored_bytes: 140 * MiB,
    new_bytes: 12 * MiB,
    gpu: {},
    gpu_bytes: 0,
    dump_seconds: 0.84,
    pause_seconds: 0.91,
    criu_version: '4.2.1',
    python_version: '3.11.7',
    kernel_release: '6.8.0',
    ...fields
  };
}

const H200 = {
  gpus: [{ name: 'NVIDIA H200', uuid: 'GPU-1' }],
  used_gpus: ['GPU-1']
};

const NOTEBOOK_SNAPSHOTS = [
  snapshot({
    sequence: 5,
    created: ago(20),
    trigger: 'periodic',
    status: 'uploading',
    stored_bytes: undefined,
    new_bytes: undefined,
    total_bytes: 3.1 * GiB,
    gpu: H200,
    gpu_bytes: 2.5 * GiB
  }),
  snapshot({
    sequence: 4,
    created: ago(3 * 60 + 5),
    trigger: 'manual',
    total_bytes: 3.0 * GiB,
    stored_bytes: 1.1 * GiB,
    new_bytes: 312 * MiB,
    gpu: H200,
    gpu_bytes: 2.5 * GiB
  }),
  snapshot({
    sequence: 3,
    created: ago(2 * 3600),
    trigger: 'idle-suspend',
    status: 'upload-failed',
    error:
      'S3 endpoint https://s3.example.org is unreachable (connection refused)',
    stored_bytes: undefined,
    new_bytes: undefined,
    total_bytes: 2.9 * GiB,
    gpu: H200,
    gpu_bytes: 2.4 * GiB
  }),
  snapshot({
    sequence: 2,
    created: ago(26 * 3600),
    trigger: 'before-shutdown',
    host: 'gpu-node-3',
    total_bytes: 800 * MiB,
    stored_bytes: 210 * MiB,
    new_bytes: 210 * MiB
  })
];

const STORE_SNAPSHOTS = [
  NOTEBOOK_SNAPSHOTS[1],
  snapshot({
    lineage: 'b0b0b0b0b0b0b0b0',
    notebook_path: 'projects/vision/train-resnet.ipynb',
    created: ago(40 * 60),
    trigger: 'periodic',
    host: 'gpu-node-2',
    total_bytes: 9.5 * GiB,
    stored_bytes: 4.2 * GiB,
    new_bytes: 96 * MiB,
    gpu: { gpus: [{ name: 'NVIDIA A100-SXM4-80GB', uuid: 'GPU-9' }] },
    gpu_bytes: 7.8 * GiB
  }),
  snapshot({
    lineage: 'c0c0c0c0c0c0c0c0',
    notebook_path: 'analysis.ipynb',
    created: ago(5 * 86400),
    trigger: 'manual',
    host: 'cpu-node-1',
    total_bytes: 96 * MiB,
    stored_bytes: 24 * MiB,
    new_bytes: 24 * MiB
  })
];

const POLICY = {
  store: 's3',
  location: 's3://team-kernel-snapshots/kernel-snapshots',
  periodic_interval: 600,
  keep_last: 10,
  max_store_bytes: 50 * GiB,
  snapshot_before_shutdown: true,
  idle_suspend_after: 1800,
  suspend_cpu_kernels: false
};

/** Show the panel from its top (a click may have scrolled it). */
async function scrollToTop(panel: Locator): Promise<void> {
  await panel.evaluate(node => {
    node.querySelectorAll('*').forEach(element => {
      element.scrollTop = 0;
    });
  });
}

test('the panel in every state (mocked API)', async ({ page }) => {
  await page.goto();
  await page.notebook.createNew('gallery.ipynb', { kernel: SNAPSHOT_KERNEL });
  await page.notebook.setCell(
    0,
    'code',
    'import numpy  # pretend: a GPU model'
  );
  const kernelId = await currentKernelId(page);

  // What the mocked server says; the tests below change it.
  const mock = {
    state: 'snapshotting',
    job: true,
    listError: false,
    failSnapshot: false,
    storeError: ''
  };
  const failedJob = {
    id: 'fedcba9876543210',
    kind: 'snapshot',
    kernel_id: kernelId,
    status: 'running',
    phase: 'dumping',
    done_bytes: 0,
    total_bytes: 0,
    started: Date.now() / 1000,
    finished: null,
    result: null,
    error: null
  };
  const job = {
    id: '0123456789abcdef',
    kind: 'snapshot',
    kernel_id: kernelId,
    status: 'running',
    phase: 'uploading',
    done_bytes: 1.3 * GiB,
    total_bytes: 3.1 * GiB,
    started: Date.now() / 1000 - 4,
    finished: null,
    result: null,
    error: null
  };
  const json = (route: Route, body: unknown, status = 200) =>
    route.fulfill({
      status,
      contentType: 'application/json',
      body: JSON.stringify(body)
    });

  await page.route(
    url => url.pathname.startsWith('/api/snapshots'),
    async route => {
      const url = new URL(route.request().url());
      const rest = url.pathname.replace(/^\/api\/snapshots\/?/, '');
      if (
        route.request().method() === 'POST' &&
        rest === '' &&
        mock.failSnapshot
      ) {
        return json(route, { job: failedJob }, 202);
      }
      if (route.request().method() !== 'GET') {
        return route.continue();
      }
      if (rest === `jobs/${failedJob.id}`) {
        return json(route, {
          ...failedJob,
          status: 'failed',
          finished: Date.now() / 1000,
          error: {
            code: 'dump-failed',
            message:
              'criu dump failed: the kernel holds a TCP connection to 10.0.0.5:5432.',
            hint: 'Close database connections before snapshotting, or run `jupyter snapshot doctor`.'
          }
        });
      }
      if (rest === '') {
        if (mock.listError) {
          return json(
            route,
            {
              message:
                'The store cannot be read: s3://team-kernel-snapshots: AccessDenied',
              reason: 'store-error',
              hint: 'Check the S3 credentials of the Jupyter server (AWS_PROFILE, instance role).'
            },
            503
          );
        }
        const kernel = url.searchParams.get('kernel_id');
        const lineage = url.searchParams.get('lineage');
        return json(route, {
          snapshots: url.searchParams.get('path')
            ? NOTEBOOK_SNAPSHOTS
            : kernel
              ? NOTEBOOK_SNAPSHOTS.filter(s => s.kernel_id === kernel)
              : lineage
                ? NOTEBOOK_SNAPSHOTS.filter(s => s.lineage === lineage)
                : STORE_SNAPSHOTS,
          store_error: mock.storeError
        });
      }
      if (rest === 'policy') {
        return json(route, POLICY);
      }
      if (rest === 'kernels') {
        return json(route, {
          kernels: [
            {
              kernel_id: kernelId,
              snapshots: true,
              state: mock.state,
              execution_state: 'idle',
              lineage: LINEAGE,
              sequence: 4,
              executions_since_snapshot: 3,
              gpu: {
                processes: 1,
                bytes: mock.state === 'suspended' ? 0 : 2.6 * GiB,
                utilization: 0
              },
              job: mock.job ? job : null
            }
          ]
        });
      }
      if (rest.startsWith('jobs/')) {
        return json(
          route,
          mock.job ? job : { ...job, status: 'done', phase: 'done' }
        );
      }
      return route.continue();
    }
  );

  const panel = await openSnapshotsPanel(page);
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  const items = snapshotCards(panel);
  await expect(items).toHaveCount(4);
  await expect(panel.getByRole('status').first()).toContainText(
    'uploading 1.3 GiB of the 3.1 GiB image'
  );
  await expect(
    page.getByRole('status', { name: /Kernel snapshot state: snapshotting/ })
  ).toBeVisible();
  await expect(items.nth(0)).toContainText('uploading');
  await expect(items.nth(1)).toContainText('GPU 2.5 GiB');
  await expect(items.nth(1)).toContainText('kernel +3');
  await expect(items.nth(2)).toContainText('upload failed');
  await expect(items.nth(3)).toContainText('before shutdown');
  await waitForToasts(page);
  await scrollToTop(panel);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-gpu-snapshots-and-progress.png')
  });
  const toolbar = await page.notebook.getToolbarLocator();
  await toolbar!.screenshot({
    path: path.join(SCREENSHOTS, 'notebook-toolbar-snapshotting.png')
  });

  // The server policy, read-only.
  await panel.getByText('Server policy').click();
  const policy = panel.getByRole('group');
  await expect(policy).toContainText('every 10 min');
  await expect(policy).toContainText('s3://team-kernel-snapshots');
  await policy.screenshot({
    path: path.join(SCREENSHOTS, 'panel-server-policy.png')
  });
  await panel.getByText('Server policy').click();

  // A suspended kernel: said in the panel and next to the kernel status.
  mock.state = 'suspended';
  mock.job = false;
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  await expect(panel.getByText('Kernel suspended')).toBeVisible();
  await expect(panel.getByRole('button', { name: 'Resume now' })).toBeVisible();
  const indicator = page.getByRole('status', {
    name: 'Kernel snapshot state: suspended'
  });
  await expect(indicator).toBeVisible();
  await waitForToasts(page);
  await scrollToTop(panel);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-suspended-kernel.png')
  });
  await toolbar!.screenshot({
    path: path.join(SCREENSHOTS, 'notebook-toolbar-suspended.png')
  });

  // Every snapshot in the store.
  await panel.getByRole('switch', { name: 'Show all' }).check();
  await expect(panel.getByText('All in the store (3)')).toBeVisible();
  await expect(items.nth(1)).toContainText('train-resnet.ipynb');
  await scrollToTop(panel);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-show-all.png')
  });

  // The store cannot be read.
  mock.listError = true;
  await panel.getByRole('switch', { name: 'Show all' }).uncheck();
  await expect(panel.getByText('Cannot load the snapshots')).toBeVisible();
  await expect(panel.getByText(/AccessDenied/)).toBeVisible();
  await expect(panel.getByText(/Check the S3 credentials/)).toBeVisible();
  await scrollToTop(panel);
  await panel.screenshot({
    path: path.join(SCREENSHOTS, 'panel-store-error.png')
  });

  // A snapshot that fails: a notification with the server's reason and what to do.
  mock.listError = false;
  mock.state = 'running';
  mock.failSnapshot = true;
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  await panel.getByRole('button', { name: 'Snapshot kernel' }).click();
  const toast = page.locator('.Toastify__toast').filter({
    hasText: 'Snapshot of gallery.ipynb failed'
  });
  await expect(toast).toContainText('criu dump failed');
  await expect(toast).toContainText('Close database connections');
  await toast.screenshot({
    path: path.join(SCREENSHOTS, 'notification-snapshot-failed.png')
  });
  await toast.getByRole('button', { name: 'Details' }).click();
  const details = page.getByRole('dialog');
  await expect(details).toContainText('What to do:');
  await details.getByRole('button', { name: 'Ok' }).click();

  // The store is unreachable: the server still lists the snapshots waiting for upload.
  mock.storeError = 'S3 endpoint https://s3.example.org timed out after 10 s';
  await panel.getByRole('button', { name: 'Refresh the snapshots' }).click();
  await expect(panel.getByText('The store cannot be reached')).toBeVisible();
  await expect(panel.getByText(/timed out after 10 s/)).toBeVisible();
});
