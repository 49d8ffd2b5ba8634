package progress

import "errors"

// ErrTopic marks a progress topic that is missing and that the relay may not
// create, or that cannot be used. Retrying cannot fix it: the operator must
// create the topic or grant the right.
var ErrTopic = errors.New("progress topic unusable")

// ErrTopicMissing marks a read of a progress topic that the brokers do not
// have (any more): deleted, or lost with a broker's data. Recreate makes it
// again.
var ErrTopicMissing = errors.New("progress topic missing on the brokers")

// ErrConnect marks a failure to connect to the brokers; the error also
// wraps sarama's, for the caller to explain (credentials, certificates).
var ErrConnect = errors.New("progress: cannot connect to kafka")
