/**
 * A stand-in for the Jupyter server in the unit tests: the REST API of the extension as
 * a table of routes, every request recorded (model.spec.ts, commands.spec.ts).
 */
import { ServerConnection } from '@jupyterlab/services';

/** One request the model made: method, path below /api/snapshots (with query), body. */
export interface IRequest {
  method: string;
  path: string;
  body: any;
}

/** An answer of the stub: a status and a JSON body (or a promise of one). */
export interface IAnswer {
  status?: number;
  body?: unknown;
}

export type Route = (
  request: IRequest
) => IAnswer | Promise<IAnswer> | undefined;

const BASE_URL = 'http://localhost:8888/';
export const API = `${BASE_URL}api/snapshots`;

/** A stand-in for the Jupyter server: answers by route, records every request. */
export class StubServer {
  requests: IRequest[] = [];
  routes: Route[] = [];
  /** When set, the network fails (fetch rejects). */
  down = false;

  readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings(
    {
      baseUrl: BASE_URL,
      wsUrl: 'ws://localhost:8888/',
      token: '',
      appendToken: false,
      fetch: (input: RequestInfo, init?: RequestInit) =>
        this._fetch(input, init)
    }
  );

  /** Answer `METHOD path` (the path with its query, below /api/snapshots). */
  on(method: string, path: string, answer: IAnswer | Route): void {
    this.routes.unshift(request =>
      request.method === method && request.path === path
        ? typeof answer === 'function'
          ? answer(request)
          : answer
        : undefined
    );
  }

  /** The paths of the requests made with a method. */
  paths(method = 'GET'): string[] {
    return this.requests.filter(r => r.method === method).map(r => r.path);
  }

  private async _fetch(
    input: RequestInfo,
    init?: RequestInit
  ): Promise<Response> {
    if (this.down) {
      throw new TypeError('Failed to fetch');
    }
    const request = input instanceof Request ? input : new Request(input, init);
    const url = request.url;
    expect(url.startsWith(API)).toBe(true);
    // makeRequest adds a timestamp to GET requests against caches: drop it.
    const path = url
      .slice(API.length)
      .replace(/^\//, '')
      .replace(/[?&]\d+$/, '');
    // Recorded at once (the body follows): a request is seen when the model makes it.
    const recorded: IRequest = {
      method: request.method,
      path,
      body: undefined
    };
    this.requests.push(recorded);
    const text = init?.body ?? (await request.text());
    recorded.body = text ? JSON.parse(String(text)) : undefined;
    for (const route of this.routes) {
      const answer = await route(recorded);
      if (answer) {
        const status = answer.status ?? 200;
        return new Response(
          answer.body === undefined || status === 204
            ? null
            : JSON.stringify(answer.body),
          { status, headers: { 'Content-Type': 'application/json' } }
        );
      }
    }
    return new Response(JSON.stringify({ message: `no route for ${path}` }), {
      status: 404
    });
  }
}
