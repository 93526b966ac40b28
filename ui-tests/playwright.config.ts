/**
 * Playwright configuration for the UI tests: Galata's defaults, Chromium from Debian
 * (/usr/bin/chromium; Playwright never downloads a browser here), a real JupyterLab
 * started from jupyter_server_test_config.py on UI_TESTS_PORT, and a real JupyterHub
 * (tests/support/hub_for_ui.py) on UI_TESTS_HUB_PORT for tests/jupyterhub.spec.ts. With
 * UI_TESTS_AGENT_URL (tests/agent.spec.ts, run by tests/test_container.py against a user
 * pod in podman) neither is started: that spec's server is the pod's.
 */
import { defineConfig } from '@playwright/test';

// eslint-disable-next-line @typescript-eslint/no-var-requires
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const port = process.env.UI_TESTS_PORT ?? '8888';
const hubPort = process.env.UI_TESTS_HUB_PORT ?? '8000';

export default defineConfig({
  ...baseConfig,
  testDir: './tests',
  outputDir: './test-results',
  reporter: [['list']],
  timeout: 180_000,
  expect: { timeout: 30_000 },
  retries: 0,
  workers: 1,
  fullyParallel: false,
  use: {
    ...baseConfig.use,
    baseURL: `http://localhost:${port}`,
    viewport: { width: 1600, height: 900 },
    // A trace only when asked (UI_TESTS_TRACE=retain-on-failure): recording one keeps the
    // browser painting and snapshotting the page, which doubled Chromium's CPU time in a
    // test (73 s against 33 s) and made it a third slower. A failing test's screenshot is
    // kept either way.
    trace: (process.env.UI_TESTS_TRACE ?? 'off') as 'off' | 'retain-on-failure' | 'on',
    screenshot: 'only-on-failure',
    // Video needs Playwright's own ffmpeg download: off.
    video: 'off',
    launchOptions: {
      executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium',
      args: [
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
        '--no-first-run'
      ]
    }
  },
  webServer: process.env.UI_TESTS_AGENT_URL
    ? []
    : [
        {
          // The server's log is long: it goes to ui-tests/jupyter-server.log.
          command:
            'jupyter lab --config jupyter_server_test_config.py > jupyter-server.log 2>&1',
          url: `http://localhost:${port}/lab`,
          timeout: 120_000,
          reuseExistingServer: !!process.env.UI_TESTS_REUSE_SERVER,
          stdout: 'pipe',
          stderr: 'pipe'
        },
        {
          // Ready once it prints its URL and admin token: the tests get them as
          // UI_TESTS_HUB_URL and UI_TESTS_HUB_TOKEN. Its log (with its servers') goes to
          // ui-tests/jupyterhub.log when it stops.
          command: `python -m tests.support.hub_for_ui --port ${hubPort} --log ui-tests/jupyterhub.log`,
          cwd: '..',
          wait: {
            stdout:
              /UI test hub ready at (?<ui_tests_hub_url>\S+) admin token (?<ui_tests_hub_token>\w+)/
          },
          timeout: 120_000,
          // SIGTERM: the hub stops its servers, which snapshot and stop their kernels, and
          // tests/support/hub.py kills whatever is left; SIGKILL would leave all of it running.
          gracefulShutdown: { signal: 'SIGTERM', timeout: 180_000 },
          stderr: 'pipe'
        }
      ]
});
