/**
 * Build the prebuilt (federated) extension into ../jupyter_ext/labextension with
 * @jupyter/builder, without needing Python or JupyterLab on the PATH, then add
 * install.json (how `jupyter labextension list` says the extension was installed).
 *
 *   node scripts/build-labextension.mjs [--development] [--watch]
 */
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const require = createRequire(join(root, 'package.json'));
const builder = require.resolve('@jupyter/builder/lib/build-labextension.js');
const coreMeta = require.resolve('@jupyterlab/core-meta/core.package.json');

const args = [builder, '--core-package-file', coreMeta];
for (const flag of process.argv.slice(2)) {
  args.push(flag);
}
args.push(root);

const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));
const outputDir = resolve(root, pkg.jupyterlab.outputDir);
const copyInstallJson = () => {
  mkdirSync(outputDir, { recursive: true });
  copyFileSync(join(root, 'install.json'), join(outputDir, 'install.json'));
};
copyInstallJson(); // first too: --watch never returns

const result = spawnSync(process.execPath, args, {
  cwd: root,
  stdio: 'inherit'
});
if (result.status !== 0) {
  process.exit(result.status ?? 1);
}

copyInstallJson();
console.log(`Built ${pkg.name} into ${outputDir}`);
