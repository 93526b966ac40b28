/**
 * The store's key would be lost with this machine: the panel says so once, plainly, with
 * the command that keeps a copy (the server's policy carries the notice).
 */
import { Notification } from '@jupyterlab/apputils';
import { Signal } from '@lumino/signaling';

import { connectNotifications } from '../notify';
import type { IPolicy, ISnapshotsModel } from '../tokens';

class FakeModel {
  policy: IPolicy | null = null;
  settings = { notifyBackground: false };
  readonly changed = new Signal<this, void>(this);
  readonly jobStarted = new Signal<this, unknown>(this);
  readonly jobChanged = new Signal<this, unknown>(this);
  readonly jobFinished = new Signal<this, unknown>(this);
}

describe('the key notice', () => {
  it('is said once, and not before the policy says it', () => {
    const warning = jest.spyOn(Notification, 'warning');
    const model = new FakeModel();
    const stop = connectNotifications(model as unknown as ISnapshotsModel);
    model.policy = { key_notice: '' };
    model.changed.emit();
    expect(warning).not.toHaveBeenCalled();
    const notice =
      "The key of your snapshots in s3://b/p is only on this machine ... Run 'jupyter snapshot store passphrase' once ...";
    model.policy = { key_notice: notice };
    model.changed.emit();
    model.changed.emit();
    expect(warning).toHaveBeenCalledTimes(1);
    expect(warning).toHaveBeenCalledWith(notice, { autoClose: false });
    stop();
    warning.mockRestore();
  });
});
