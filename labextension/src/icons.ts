import { LabIcon } from '@jupyterlab/ui-components';

/** A camera over a stack: a saved copy of the kernel's memory. */
const SNAPSHOT_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M9.2 3 7.6 5H5a2 2 0 0 0-2 2v9a2 2 0 0 0 2 2h14a2 2 0 0 0 2-2V7a2 2 0 0 0-2-2h-2.6l-1.6-2H9.2zM12 7.5a4 4 0 1 1 0 8 4 4 0 0 1 0-8zm0 1.8a2.2 2.2 0 1 0 0 4.4 2.2 2.2 0 0 0 0-4.4z"/>
    <path d="M4 19.5h16v1.5H4z"/>
  </g>
</svg>`;

export const snapshotIcon = new LabIcon({
  name: 'jupyter-kernel-snapshots:snapshot',
  svgstr: SNAPSHOT_SVG
});
