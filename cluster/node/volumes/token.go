package volumes

import (
	"time"

	v1 "k8s.io/api/core/v1"
)

// refreshAt is when a token should be renewed: at 80% of its lifetime and at
// least daily, as the kubelet does, so a pod never holds an expired token.
func refreshAt(t TokenFile) time.Time {
	life := t.Expires.Sub(t.Issued)
	if life <= 0 {
		return t.Issued
	}
	d := life * 8 / 10
	if d > 24*time.Hour {
		d = 24 * time.Hour
	}
	return t.Issued.Add(d)
}

// RefreshTokens renews the tokens of vol that are due at now and returns when
// the next one falls due (zero if the volume has no tokens).
func (m *Materialiser) RefreshTokens(pod *v1.Pod, vol *Volume, now time.Time) (time.Time, error) {
	var next time.Time
	var firstErr error
	for i := range vol.Tokens {
		t := &vol.Tokens[i]
		if !now.Before(refreshAt(*t)) {
			tok, exp, err := m.Tokens.Token(pod, serviceAccountOf(pod), t.Audience, t.ExpirationSeconds)
			if err == nil {
				err = WriteFileAtomic(t.Path, []byte(tok), t.Mode)
			}
			if err == nil && fsGroupOf(pod) != nil {
				err = ApplyFSGroup(t.Path, *fsGroupOf(pod), true)
			}
			if err != nil {
				if firstErr == nil {
					firstErr = err
				}
				// Try again in a minute rather than at once.
				retry := now.Add(time.Minute)
				if next.IsZero() || retry.Before(next) {
					next = retry
				}
				continue
			}
			t.Issued, t.Expires = now, exp
		}
		if at := refreshAt(*t); next.IsZero() || at.Before(next) {
			next = at
		}
	}
	return next, firstErr
}
