/* Loaded by JupyterLab as the extension's style module. */
import './base.css';
