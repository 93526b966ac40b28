/**
 * Two real Jupyter servers, A and B (tests/support/nodes_for_ui.py), sharing one S3 store (moto)
 * and one notebook directory, for the UI tests of a node's loss (nodes.spec.ts,
 * kernels.spec.ts): their URLs and tokens, a command to kill one as a node failure would,
 * or started again (restart.spec.ts), REST calls, and JupyterLab of a node in a browser
 * context of its own.
 */
import { APIRequestContext, Browser, expect, Page } from '@playwright/test';
import { ChildProcessWithoutNullStreams, spawn } from 'child_process';
import * as path from 'path';
import * as readline from 'readline';

export interface INode {
  url: string;
  token: string;
}

/** tests/support/nodes_for_ui.py: its servers, and a way to send it commands. */
export class Nodes {
  static async launch(): Promise<Nodes> {
    const child = spawn(
      'python',
      ['-m', 'tests.support.nodes_for_ui', '--log', 'ui-tests/nodes.log'],
      { cwd: path.resolve(__dirname, '..', '..'), stdio: 'pipe' }
    );
    child.stderr.on('data', data => process.stderr.write(data));
    const lines = readline.createInterface({ input: child.stdout });
    const nodes = new Nodes(child, lines);
    const ready = JSON.parse(await nodes.nextLine(180_000));
    nodes.a = ready.a;
    nodes.b = ready.b;
    return nodes;
  }

  private constructor(
    private readonly _child: ChildProcessWithoutNullStreams,
    lines: readline.Interface
  ) {
    lines.on('line', line => {
      const waiter = this._waiters.shift();
      if (waiter) {
        waiter(line);
      } else {
        this._lines.push(line);
      }
    });
    _child.on('exit', code => {
      for (const waiter of this._waiters.splice(0)) {
        waiter(`exited ${code}`);
      }
    });
  }

  a: INode = { url: '', token: '' };
  b: INode = { url: '', token: '' };

  /** Whether the helper still runs (it says on stderr why it stopped). */
  get running(): boolean {
    return this._child.exitCode === null && this._child.signalCode === null;
  }

  /** The next line the helper prints. */
  nextLine(timeout: number): Promise<string> {
    const queued = this._lines.shift();
    if (queued !== undefined) {
      return Promise.resolve(queued);
    }
    return new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new Error('tests.support.nodes_for_ui did not answer')),
        timeout
      );
      this._waiters.push(line => {
        clearTimeout(timer);
        resolve(line);
      });
    });
  }

  /** kill -9 a server and every process it started, as a node failure would. */
  async kill(name: 'a' | 'b'): Promise<void> {
    this._child.stdin.write(`kill ${name}\n`);
    expect(await this.nextLine(60_000)).toBe(`killed ${name}`);
  }

  /** Start a killed server again, at its URL with its token and folders. */
  async start(name: 'a' | 'b'): Promise<void> {
    this._child.stdin.write(`start ${name}\n`);
    expect(await this.nextLine(120_000)).toBe(`started ${name}`);
  }

  /** Stop the servers and moto (the helper cleans up on end of input). */
  async stop(): Promise<void> {
    if (this._child.exitCode !== null) {
      return;
    }
    const exited = new Promise(resolve => this._child.on('exit', resolve));
    this._child.stdin.end();
    await exited;
  }

  private _lines: string[] = [];
  private _waiters: ((line: string) => void)[] = [];
}

/** A REST call to a node. */
export async function api(
  request: APIRequestContext,
  node: INode,
  method: 'GET' | 'PUT',
  endpoint: string,
  data?: unknown
): Promise<any> {
  const response = await request.fetch(`${node.url}${endpoint}`, {
    method,
    data,
    headers: { Authorization: `token ${node.token}` }
  });
  expect(response.ok(), await response.text()).toBeTruthy();
  return response.json();
}

/** JupyterLab of a node with the notebook open, in a browser context of its own. */
export async function openNotebook(
  browser: Browser,
  node: INode,
  notebook: string
): Promise<Page> {
  const context = await browser.newContext({
    viewport: { width: 1400, height: 900 }
  });
  const page = await context.newPage();
  await page.goto(`${node.url}lab/tree/${notebook}?token=${node.token}`);
  await expect(page.getByRole('tab', { name: 'Kernel Snapshots' })).toBeVisible(
    { timeout: 60_000 }
  );
  return page;
}
