/**
 * The Kernel Snapshots panel in JupyterLab behind a real JupyterHub (tests/support/hub_for_ui.py,
 * started by playwright.config.ts: configurable-http-proxy, spawned single-user servers
 * with the snapshot extension, real snapshot kernels). Everything goes through the hub as
 * a user's browser would: the login page, the spawn, the OAuth hand-over to the user's
 * server. An admin stops the server through the hub's REST API, as the idle culler does;
 * the server snapshots its kernel on the way out, and when the user starts it again the
 * notebook comes back with an offer to restore that snapshot.
 *
 * Plain Playwright pages, not Galata's fixtures: those talk to a token-less JupyterLab at
 * the base URL, while here the browser must log in on the hub first.
 */
import {
  APIRequestContext,
  expect,
  Locator,
  Page,
  test
} from '@playwright/test';
import * as path from 'path';

import {
  openSnapshotsPanel,
  SCREENSHOTS,
  waitForRenamedListing,
  waitForToasts,
  snapshotCards
} from './helpers';

const HUB = process.env.UI_TESTS_HUB_URL ?? '';
const TOKEN = process.env.UI_TESTS_HUB_TOKEN ?? '';
const USER = 'alice';
const NOTEBOOK = 'hub-state.ipynb';

/** The hub's REST API (/hub/api/...) with the admin service's token. */
function hubApi(
  request: APIRequestContext,
  method: 'GET' | 'DELETE',
  endpoint: string
) {
  return request.fetch(`${HUB}hub/api/${endpoint}`, {
    method,
    headers: { Authorization: `token ${TOKEN}` }
  });
}

/** Whether the hub has the user's default server (running, starting or stopping). */
async function hasServer(request: APIRequestContext): Promise<boolean> {
  const response = await hubApi(request, 'GET', `users/${USER}`);
  if (response.status() === 404) {
    return false; // The user never logged in.
  }
  expect(response.ok(), await response.text()).toBeTruthy();
  const user = (await response.json()) as { servers: Record<string, unknown> };
  return '' in user.servers;
}

/**
 * Stop the user's server as an admin or the idle culler does, and wait until the hub
 * has no server for the user any more (the snapshots before shutdown are taken by then).
 */
async function stopServer(request: APIRequestContext): Promise<void> {
  const response = await hubApi(request, 'DELETE', `users/${USER}/server`);
  expect([202, 204], await response.text()).toContain(response.status());
  await expect
    .poll(() => hasServer(request), {
      timeout: 150_000,
      message: `the hub stops ${USER}'s server`
    })
    .toBe(false);
}

/**
 * Wait until the browser is in JupyterLab at the user's server behind the hub, with the
 * snapshot extension loaded.
 */
async function waitForLab(page: Page): Promise<void> {
  await page.waitForURL(url => url.pathname.startsWith(`/user/${USER}/lab`), {
    timeout: 150_000
  });
  await expect(page.getByRole('tab', { name: 'Kernel Snapshots' })).toBeVisible(
    { timeout: 60_000 }
  );
}

/**
 * Wait until JupyterLab has saved its layout with the notebook open (its workspace, on
 * the user's server). Lab saves it a moment after the layout changes; a server stopped
 * before that reopens without the notebook (a race this test once lost on a slow run).
 */
async function waitForSavedLayout(page: Page): Promise<void> {
  await expect
    .poll(
      async () => {
        const response = await page.request.get(
          `${HUB}user/${USER}/lab/api/workspaces`
        );
        return response.ok() ? await response.text() : `${response.status()}`;
      },
      { timeout: 60_000, message: `the workspace saved with ${NOTEBOOK} open` }
    )
    .toContain(`notebook:${NOTEBOOK}`);
}

/** Wait until the notebook's kernel is a snapshot kernel and idle (the status bar). */
async function waitForIdleKernel(page: Page): Promise<void> {
  await expect(page.getByText('Python 3 (snapshots) | Idle')).toBeVisible({
    timeout: 60_000
  });
}

/** The code cell `index` of the notebook in the main area. */
function cell(page: Page, index: number): Locator {
  return page
    .locator('.jp-MainAreaWidget:visible .jp-Notebook .jp-CodeCell')
    .nth(index);
}

/** Type `code` into code cell `index` and run it (Shift+Enter, as a user does). */
async function runCell(page: Page, index: number, code: string): Promise<void> {
  const editor = cell(page, index).locator('.cm-content');
  await editor.click();
  await editor.fill(code);
  await page.keyboard.press('Shift+Enter');
}

test.describe('JupyterHub', () => {
  test.beforeAll(() => {
    expect(HUB, 'UI_TESTS_HUB_URL (set by playwright.config.ts)').toMatch(
      /^http/
    );
    expect(TOKEN, 'UI_TESTS_HUB_TOKEN (set by playwright.config.ts)').not.toBe(
      ''
    );
  });

  // Whatever happened, the user's server and its kernel stop now, not with the hub.
  test.afterEach(async ({ request }) => {
    if (await hasServer(request)) {
      await stopServer(request);
    }
  });

  test('a server stopped by the hub offers its kernel back', async ({
    page,
    request
  }) => {
    test.setTimeout(300_000);

    // Log in: the hub spawns the user's server and sends the browser to JupyterLab.
    await page.goto(`${HUB}hub/login`);
    await page.getByLabel('Username:').fill(USER);
    await page.getByLabel('Password:', { exact: true }).fill('any password');
    await page.getByRole('button', { name: 'Sign in' }).click();
    await waitForLab(page);

    // A notebook with the snapshot kernel, from the launcher; it sets a variable.
    await page
      .locator('.jp-LauncherCard[data-category="Notebook"]')
      .filter({ hasText: 'Python 3 (snapshots)' })
      .click();
    await waitForIdleKernel(page);
    await runCell(page, 0, 'x = 42');
    await expect(cell(page, 0).locator('.jp-InputPrompt')).toHaveText('[1]:');

    // Save it, named on the first save.
    await page.keyboard.press('Control+s');
    const rename = page.getByRole('dialog');
    await expect(rename).toContainText('Rename file');
    await rename.getByRole('textbox', { name: 'File name' }).fill(NOTEBOOK);
    await rename.getByRole('button', { name: 'Rename and Save' }).click();
    await expect(page.getByRole('tab', { name: NOTEBOOK })).toBeVisible();
    await waitForRenamedListing(page, NOTEBOOK);

    // A snapshot from the notebook toolbar, listed in the panel.
    const panel = await openSnapshotsPanel(page);
    await page
      .getByRole('button', { name: 'Snapshot', exact: true })
      .first()
      .click();
    await expect(page.getByText(`Snapshot of ${NOTEBOOK} taken`)).toBeVisible();
    const items = snapshotCards(panel);
    await expect(items).toHaveCount(1);
    await expect(items.first()).toContainText('manual');
    await expect(items.first()).toContainText('complete');

    // An admin (or the idle culler) stops the server: it snapshots the kernel first.
    await waitForSavedLayout(page);
    await stopServer(request);

    // The user starts it again from the hub's home page; JupyterLab reopens the
    // notebook, whose kernel is gone, and offers the snapshot taken at the stop.
    await page.goto(`${HUB}hub/home`);
    await page.getByRole('button', { name: 'Start My Server' }).click();
    await waitForLab(page);
    const offer = page.getByRole('dialog');
    await expect(offer).toContainText('Restore the kernel from its snapshot?', {
      timeout: 60_000
    });
    await expect(offer).toContainText(`${NOTEBOOK} has no running kernel`);
    await expect(offer).toContainText('before shutdown');
    await offer.screenshot({
      path: path.join(SCREENSHOTS, 'hub-restore-offer-dialog.png')
    });
    await offer.getByRole('button', { name: 'Restore newest' }).click();
    await expect(
      page.getByText(`Kernel of ${NOTEBOOK} restored.`)
    ).toBeVisible();
    await waitForIdleKernel(page);

    // The restored kernel still has the variable.
    await runCell(page, 1, 'print(x)');
    await expect(cell(page, 1).locator('.jp-OutputArea-output')).toHaveText(
      '42'
    );

    // Both snapshots are listed: the one taken at the stop is the newest.
    const panelAfter = await openSnapshotsPanel(page);
    const itemsAfter = snapshotCards(panelAfter);
    await expect(itemsAfter).toHaveCount(2);
    await expect(itemsAfter.nth(0)).toContainText('before shutdown');
    await expect(itemsAfter.nth(1)).toContainText('manual');
    await waitForToasts(page);
    await panelAfter.screenshot({
      path: path.join(SCREENSHOTS, 'hub-panel-after-restore.png')
    });
  });
});
