package main

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// histogram is one Prometheus histogram read from a /metrics page:
// cumulative counts per upper bound, the sum and the count.
type histogram struct {
	bounds []float64
	counts []float64
	sum    float64
	count  float64
}

// scrapeHistograms reads the named histograms from a Prometheus text page.
func scrapeHistograms(ctx context.Context, url string, names ...string) (map[string]*histogram, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	out := map[string]*histogram{}
	for _, n := range names {
		out[n] = &histogram{}
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		metric, value, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		for name, h := range out {
			switch {
			case metric == name+"_sum":
				h.sum = v
			case metric == name+"_count":
				h.count = v
			case strings.HasPrefix(metric, name+`_bucket{le="`):
				le := strings.TrimSuffix(strings.TrimPrefix(metric, name+`_bucket{le="`), `"}`)
				bound := math.Inf(1)
				if le != "+Inf" {
					if bound, err = strconv.ParseFloat(le, 64); err != nil {
						continue
					}
				}
				h.bounds = append(h.bounds, bound)
				h.counts = append(h.counts, v)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for _, h := range out {
		sort.Sort(byBound{h})
	}
	return out, nil
}

type byBound struct{ h *histogram }

func (s byBound) Len() int           { return len(s.h.bounds) }
func (s byBound) Less(i, j int) bool { return s.h.bounds[i] < s.h.bounds[j] }
func (s byBound) Swap(i, j int) {
	s.h.bounds[i], s.h.bounds[j] = s.h.bounds[j], s.h.bounds[i]
	s.h.counts[i], s.h.counts[j] = s.h.counts[j], s.h.counts[i]
}

// minus is what was observed between an earlier scrape and this one.
func (h *histogram) minus(earlier *histogram) *histogram {
	d := &histogram{sum: h.sum - earlier.sum, count: h.count - earlier.count,
		bounds: append([]float64(nil), h.bounds...), counts: append([]float64(nil), h.counts...)}
	if len(earlier.counts) == len(h.counts) {
		for i := range d.counts {
			d.counts[i] -= earlier.counts[i]
		}
	}
	return d
}

func (h *histogram) mean() float64 {
	if h.count == 0 {
		return 0
	}
	return h.sum / h.count
}

// quantile interpolates linearly inside the bucket that holds quantile q,
// as Prometheus's histogram_quantile does; its error is the bucket's width.
func (h *histogram) quantile(q float64) float64 {
	if h.count == 0 || len(h.bounds) == 0 {
		return 0
	}
	rank := q * h.count
	lower, below := 0.0, 0.0
	for i, c := range h.counts {
		if c >= rank {
			if math.IsInf(h.bounds[i], 1) {
				return lower
			}
			if c == below {
				return h.bounds[i]
			}
			return lower + (h.bounds[i]-lower)*(rank-below)/(c-below)
		}
		lower, below = h.bounds[i], c
	}
	return lower
}
