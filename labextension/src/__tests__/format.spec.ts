/**
 * How the panel names what took a snapshot: the user reads the trigger on each card.
 */
import {
  describeJob,
  formatAbsolute,
  formatClock,
  formatPhase,
  formatRelative,
  formatSizes,
  formatStatus,
  formatTrigger
} from '../format';

describe('formatTrigger', () => {
  it('tells the culler from an admin', () => {
    expect(formatTrigger('cull')).toBe('idle cull');
    expect(formatTrigger('admin-shutdown')).toBe('shut down by an admin');
  });

  it('names the others in words, and an unknown trigger as it is', () => {
    expect(formatTrigger('long-cell')).toBe('after a long cell');
    expect(formatTrigger('before-restore')).toBe('before a restore');
    expect(formatTrigger('some-new-one')).toBe('some new one');
    expect(formatTrigger(null)).toBe('unknown');
  });
});

describe('one date format', () => {
  const now = new Date(2026, 11, 4, 22, 30).getTime();

  it('says the time today, the day before it otherwise, 24-hour', () => {
    expect(formatClock(new Date(2026, 11, 4, 22, 13), now)).toMatch(/^22:13$/);
    expect(formatClock(new Date(2026, 11, 3, 9, 5), now)).toMatch(
      /^Dec 3, 09:05$/
    );
    expect(formatClock(new Date(2025, 0, 2, 9, 5), now)).toMatch(
      /^Jan 2, 2025, 09:05$/
    );
    expect(formatAbsolute(new Date(2026, 11, 4, 22, 13, 5))).toMatch(
      /^Dec 4, 2026, 22:13:05$/
    );
  });

  it('tells relative times with the same clock, and old ones as dates', () => {
    const date = new Date(now - 52_000);
    expect(formatRelative(date, now)).toBe('52 s ago');
    expect(formatRelative(date, now + 8_000)).toBe('1 min ago');
    expect(formatRelative(new Date(2026, 9, 1, 8, 0), now)).toMatch(
      /^Oct 1, 08:00$/
    );
  });
});

describe('progress and sizes, named', () => {
  const job = (phase: string, done = 0, total = 0) =>
    ({ kind: 'snapshot', phase, done_bytes: done, total_bytes: total }) as any;

  it('counts image bytes as the image, and never says done with bytes', () => {
    expect(formatPhase(job('storing', 1024 ** 2, 4 * 1024 ** 2))).toBe(
      'storing 1.0 MiB of the 4.0 MiB image (25%)'
    );
    expect(formatPhase(job('downloading', 1024, 2048))).toBe(
      'downloading 1.0 KiB of 2.0 KiB (50%)'
    );
    expect(describeJob(job('dumping'))).toBe('Snapshot: dumping memory');
  });

  it('names the image, what is stored and what is new', () => {
    expect(
      formatSizes({
        total_bytes: 232 * 1024 ** 2,
        stored_bytes: 202 * 1024 ** 2,
        new_bytes: 3 * 1024 ** 2
      })
    ).toBe('image 232 MiB, stored as 202 MiB, 3.0 MiB new');
    expect(formatSizes({ total_bytes: 1024 })).toBe('image 1.0 KiB');
  });

  it('says storing, not uploading, for a local store', () => {
    expect(formatStatus('uploading', 'local')).toBe('storing');
    expect(formatStatus('upload-failed', 'local')).toBe('not stored');
    expect(formatStatus('uploading', 's3')).toBe('uploading');
  });
});
