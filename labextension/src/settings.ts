/**
 * The user's settings of the panel (`schema/plugin.json`), applied to the model.
 */
import type { ISettingRegistry } from '@jupyterlab/settingregistry';

import {
  DEFAULT_SETTINGS,
  ISnapshotSettings,
  ISnapshotsModel,
  PLUGIN_ID
} from './tokens';

/** Read the settings, falling back to the defaults for anything missing. */
export function readSettings(
  settings: ISettingRegistry.ISettings | null
): ISnapshotSettings {
  if (!settings) {
    return { ...DEFAULT_SETTINGS };
  }
  const composite = settings.composite as Partial<ISnapshotSettings>;
  return { ...DEFAULT_SETTINGS, ...composite };
}

/** Load the settings into the model, and follow their changes. */
export function applySettings(
  model: ISnapshotsModel,
  settingRegistry: ISettingRegistry
): void {
  let first = true;
  void settingRegistry
    .load(PLUGIN_ID)
    .then(settings => {
      const apply = () => {
        const values = readSettings(settings);
        model.settings = values;
        if (first) {
          model.showAll = values.showAllByDefault;
          first = false;
        }
      };
      apply();
      settings.changed.connect(apply);
    })
    .catch(reason => {
      console.error(
        'jupyter-kernel-snapshots: cannot load the settings',
        reason
      );
    });
}
