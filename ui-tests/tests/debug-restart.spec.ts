import { expect, test as base } from '@jupyterlab/galata';
import { currentKernelId, kernelStatus, killKernel, SNAPSHOT_KERNEL } from './helpers';

const test = base.extend({
  // eslint-disable-next-line no-empty-pattern
  kernels: async ({}, use) => { await use(null); },
  // eslint-disable-next-line no-empty-pattern
  sessions: async ({}, use) => { await use(null); }
});
test.use({ autoGoto: false });

test('debug restart', async ({ page, request }) => {
  const t0 = Date.now();
  page.on('console', m => console.log('CONSOLE', Date.now() - t0, m.type(), m.text().slice(0, 200)));
  page.on('websocket', ws => {
    if (!ws.url().includes('/channels')) return;
    console.log('WS OPEN', Date.now() - t0, ws.url());
    const show = (dir: string) => (f: { payload: string | Buffer }) => {
      const s = typeof f.payload === 'string' ? f.payload : f.payload.toString('latin1');
      const types = [...s.matchAll(/"msg_type":\s*"([a-z_]+)"/g)].map(m => m[1]);
      const st = s.match(/"execution_state":\s*"([a-z]+)"/);
      const sess = s.match(/"session":\s*"([0-9a-f-]+)"/);
      console.log(dir, Date.now() - t0, types.join(','), st ? st[1] : '', sess ? sess[1].slice(0, 8) : '');
    };
    ws.on('framereceived', show('<<'));
    ws.on('framesent', show('>>'));
    ws.on('close', () => console.log('WS CLOSE', Date.now() - t0));
  });
  await page.goto();
  await page.notebook.createNew('dbg.ipynb', { kernel: process.env.DBG_KERNEL ?? SNAPSHOT_KERNEL });
  await page.notebook.setCell(0, 'code', 'x = 1');
  await page.notebook.runCell(0, { inplace: true });
  await page.waitForTimeout(12000);
  const kernelId = await currentKernelId(page);
  console.log('KILL', Date.now() - t0);
  if (process.env.DBG_KERNEL === 'python3') {
    require('child_process').execSync(`kill -9 $(pgrep -f "[i]pykernel_launcher.*kernel-${kernelId}")`);
  } else {
    await killKernel(request, kernelId);
  }
  await page.waitForTimeout(15000);
  
  console.log('BAR', await page.locator('#jp-main-statusbar').textContent());
  expect(1).toBe(1);
});
