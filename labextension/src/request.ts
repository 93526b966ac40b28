/**
 * One way to call the server extension's REST API (`/api/snapshots...`).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import type { IErrorBody } from './tokens';

/**
 * An error answered by the server (or the network), with what to do about it.
 */
export class SnapshotAPIError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly body: IErrorBody = {}
  ) {
    super(message);
    this.name = 'SnapshotAPIError';
  }

  /** What to do about it, as the server says ('' if nothing). */
  get hint(): string {
    return this.body.hint ?? '';
  }

  /** The server's error code (e.g. `dump-failed`), or its reason. */
  get code(): string {
    return this.body.code ?? this.body.reason ?? '';
  }
}

/**
 * Call `/api/snapshots/<endPoint>` and return the JSON it answers.
 *
 * @param endPoint - path below /api/snapshots, e.g. `policy` or `?path=a.ipynb`
 * @param init - fetch options (method, body...)
 * @param settings - server connection settings
 * @returns the decoded body (`undefined` for 204 No Content)
 * @throws SnapshotAPIError with the server's `message` and `hint`
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const base = URLExt.join(settings.baseUrl, 'api', 'snapshots');
  const url = endPoint.startsWith('?')
    ? base + endPoint
    : URLExt.join(base, endPoint);

  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new SnapshotAPIError(
      `Cannot reach the Jupyter server: ${(error as Error).message ?? error}`,
      0,
      { hint: 'Check that the Jupyter server is still running.' }
    );
  }

  const text = await response.text();
  let data: any = undefined;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      data = undefined;
    }
  }

  if (!response.ok) {
    const body: IErrorBody =
      data && typeof data === 'object' ? (data as IErrorBody) : {};
    const message =
      body.message ||
      (response.status === 404
        ? 'The snapshot API is not available (HTTP 404).'
        : `${response.status} ${response.statusText || 'error'}`);
    if (!body.hint && response.status === 404 && !body.message) {
      body.hint =
        'Is the server extension "jupyter_ext" enabled? See `jupyter server extension list`.';
    }
    throw new SnapshotAPIError(message, response.status, body);
  }
  return data as T;
}

/** A JSON body for `requestAPI`. */
export function jsonBody(method: string, body: unknown): RequestInit {
  return {
    method,
    body: JSON.stringify(body),
    headers: { 'Content-Type': 'application/json' }
  };
}

/** The message and hint of any error, for a notification or the panel. */
export function describeError(error: unknown): {
  message: string;
  hint: string;
} {
  if (error instanceof SnapshotAPIError) {
    return { message: error.message, hint: error.hint };
  }
  if (error && typeof error === 'object' && 'message' in error) {
    const e = error as IErrorBody;
    return { message: String(e.message ?? ''), hint: String(e.hint ?? '') };
  }
  return { message: String(error), hint: '' };
}
