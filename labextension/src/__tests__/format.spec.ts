/**
 * How the panel names what took a snapshot: the user reads the trigger on each card.
 */
import { formatTrigger } from '../format';

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
